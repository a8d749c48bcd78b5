"""Which train_episode enable() may replace: the stock one, whose episode qca_lowmem's repeats
(switch.py). Any other (a subclass's override, a function set on the instance, an edit of the
users' file) does something the library's episode would silently drop, so enable() refuses it,
naming it, unless the user opts in with `assume_stock_episode=True`.

The stock one is recognised by its structure: each logical line's block depth (Python's own
INDENT and DEDENT tokens) and its text, stripped, with blank and comment lines dropped, must hash
to a version qca_lowmem follows. Comments, blank lines and the indentation's width pass; a
changed line, or a line moved into or out of a block, does not. Tokens are read, not the syntax
tree's printout, so that the digest is the same on every Python.
"""

import hashlib
import inspect
import io
import textwrap
import tokenize
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class StockEpisode:
    qualname: str
    digest: str
    origin: str  # the file and commit the digest was taken from


STOCK_EPISODES = (
    StockEpisode("QC_Trainer_v4.train_episode", "82c8309b301b2479c272d353afb8abcb773c3b56bcf4ec9c72429845b34e1910",
                 "Jonakss/Atheria src/trainers/qc_trainer_v4.py at c780b4c (2025-12-09)"),
    StockEpisode("QC_Trainer_v3.train_episode", "5d95e8dcea347885867298546ed1402326c981bf2adf6664bf5cf3c2d2d3c3af",
                 "Jonakss/Atheria src/trainers/qc_trainer_v3.py at ee9d178 (2025-12-02)"),
    StockEpisode("QC_Trainer_v4.train_episode", "a1b462e7b5aae7206170da8eacb755b6b20f114f1df01876db6f9e1c5e5be9eb",
                 "qca_lowmem/examples/qc_trainer_v4.py, the bundled stand-in"),
    StockEpisode("QC_Trainer_v3.train_episode", "363a5d93a3b9b698056f4a601ce9ddddfbb5c47a694837ab6ecc9950269b634d",
                 "qca_lowmem/examples/qc_trainer_v3.py, the bundled stand-in"),
)


def structure_digest(function) -> Optional[str]:
    """sha256 of the function's logical lines as (block depth, stripped text), without blank and
    comment lines; None where the source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(function))
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (OSError, TypeError, tokenize.TokenError, IndentationError, SyntaxError):
        return None
    physical = source.splitlines()
    depth, start, lines = 0, None, []
    for token in tokens:
        if token.type == tokenize.INDENT:
            depth += 1
        elif token.type == tokenize.DEDENT:
            depth -= 1
        elif token.type in (tokenize.COMMENT, tokenize.NL, tokenize.ENDMARKER):
            continue
        elif token.type == tokenize.NEWLINE:
            text = (line.strip() for line in physical[start - 1:token.start[0]])
            lines.append(f"{depth}|" + "\n".join(t for t in text if t and not t.startswith("#")))
            start = None
        elif start is None:
            start = token.start[0]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def stock_origin(function) -> Optional[str]:
    """Where the stock episode `function` matches was taken from, or None if it matches none."""
    qualname = getattr(function, "__qualname__", None)
    known = [episode for episode in STOCK_EPISODES if episode.qualname == qualname]
    if not known:
        return None
    digest = structure_digest(function)
    return next((episode.origin for episode in known if episode.digest == digest), None)


def check_stock_episode(trainer, assume_stock_episode: bool = False) -> Optional[str]:
    """Refuse, naming it, a train_episode that is not the stock one; with `assume_stock_episode`
    return the reason it would have been refused instead (the user's risk, said by enable())."""
    episode = trainer.train_episode
    function = getattr(episode, "__func__", None)
    if getattr(episode, "__self__", None) is trainer and stock_origin(function) is not None:
        return None
    found = function or episode
    name = f"{getattr(found, '__module__', '?')}.{getattr(found, '__qualname__', type(found).__name__)}"
    where = "set on the instance" if "train_episode" in vars(trainer) else "its class's"
    reason = f"{type(trainer).__name__}.train_episode is {name} ({where}), not a stock episode qca_lowmem follows"
    if assume_stock_episode:
        return reason
    raise TypeError(f"enable(): {reason}.\nenable() replaces train_episode by qca_lowmem's episode, which repeats the "
                    "stock one only: what yours does differently would be dropped. assume_stock_episode=True "
                    "runs the stock episode anyway, at your own risk")
