"""Which train_episode enable() may replace: the stock one, whose episode qca_lowmem's repeats
(switch.py). Any other (a subclass's override, a function set on the instance, a wrapper, an
edit of the users' file) does something the library's episode would silently drop, so enable()
refuses it, naming it, unless the user opts in with `assume_stock_episode=True`.

The stock one is recognised by the identity of the code that runs (code_identity.py): the
function the trainer resolves `train_episode` to, digested from its code object, must be a
version followed for the trainer's version. The check is made again at every episode (a few
microseconds: the static part of the digest is cached per code object): where the code the
trainer would run has changed since enable() (a wrapper set on the class, a module reloaded),
that episode runs the users' own train_episode, with one line. A wrapper of theirs on the
instance around the installed episode (torch.compile's, a decorator with functools.wraps) runs it
still, and is not such a change.
"""

import inspect
import logging
import types
from typing import Optional

from .code_identity import digest, followed, not_recorded, resolved
from .say import say


def episode_function(trainer, installed=None):
    """The plain function trainer.train_episode runs: the class's through the MRO, or one of the
    class's functions bound to this trainer on the instance; None for anything else. `installed`:
    what enable() set on the instance, looked through."""
    own = vars(trainer).get("train_episode", installed)
    if own is not installed and installed is not None and inspect.unwrap(own) is installed:
        installed = own  # a wrapper of theirs around it (torch.compile's, functools.wraps'): it still runs
    if own is not installed and isinstance(own, types.MethodType) and own.__self__ is trainer:
        return own.__func__ if own.__func__ is resolved(trainer, "train_episode", own) else None
    return resolved(trainer, "train_episode", installed)


def stock_origin(trainer, version: str, installed=None) -> Optional[str]:
    """Where the stock episode of `version` (QC_Trainer_v4, QC_Trainer_v3) that the trainer runs
    was taken from, or None if it runs another."""
    function = episode_function(trainer, installed)
    return followed(f"{version}.train_episode", function) if function is not None else None


def check_stock_episode(trainer, origin: Optional[str], assume_stock_episode: bool = False) -> Optional[str]:
    """Refuse, naming it, a train_episode that is not the stock one (`origin`, stock_origin's answer,
    None); with `assume_stock_episode` return the reason it would have been refused instead (the
    user's risk, said by enable())."""
    if origin is not None:
        return None
    found = getattr(trainer, "train_episode")
    found = getattr(found, "__func__", found)
    name = f"{getattr(found, '__module__', '?')}.{getattr(found, '__qualname__', type(found).__name__)}"
    where = "set on the instance" if "train_episode" in vars(trainer) else "its class's"
    if hasattr(found, "__wrapped__"):
        where += ", a wrapper (it has __wrapped__)"
    why = not_recorded()
    reason = (f"{type(trainer).__name__}.train_episode is {name} ({where}), not a stock episode qca_lowmem follows"
              + (f": {why}" if why else " (edited, or a version it has not recorded)" if where == "its class's" else ""))
    if assume_stock_episode:
        return reason
    raise TypeError(f"enable(): {reason}.\nenable() replaces train_episode by qca_lowmem's episode, which repeats the "
                    "stock one only: what yours does differently would be dropped. assume_stock_episode=True "
                    "runs the stock episode anyway, at your own risk")


class EpisodeIdentity:
    """The digest of the stock train_episode enable() replaced, checked again at each episode."""

    def __init__(self, trainer, own: Optional[str] = None):
        """`own`: why every episode runs the users' own train_episode (a Python with no digests recorded)."""
        self.digest = digest(episode_function(trainer))
        self.own = own
        self.said_for = None  # the function last said to run in its place

    def changed(self, trainer, installed):
        """None while the trainer would still run the code enable() recognised; else the
        train_episode to run in its place (the users' own, said once per change)."""
        function = getattr(type(trainer), "train_episode")
        if self.own is not None:
            return function.__get__(trainer, type(trainer))
        now = digest(episode_function(trainer, installed)) if self.digest is not None else None
        if now == self.digest:
            return None
        name = f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', '?')}"
        if self.said_for is not function:
            self.said_for = function
            say(logging.WARNING, f"{type(trainer).__name__}.train_episode now runs {name}, not the stock episode "
                                 "recognised at enable(): this episode runs it, as written")
        return function.__get__(trainer, type(trainer))
