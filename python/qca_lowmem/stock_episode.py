"""Which train_episode enable() may replace: the stock one, whose episode qca_lowmem's repeats
(integration.py). Any other (a subclass's override, a function set on the instance, an edit of
the users' file) does something the library's episode would silently drop, so enable() refuses
it, naming it.

The stock one is the bundled stand-in's (by identity) or the users' QC_Trainer_v4.train_episode,
recognised by its source: its lines stripped of indentation, blank and comment lines dropped, must
hash to a version qca_lowmem follows. Reformatting and comments pass; a changed line does not.
"""

import hashlib
import inspect
from typing import Optional

from .examples.qc_trainer_v4 import QC_Trainer_v4 as StandIn

STOCK_QUALNAME = "QC_Trainer_v4.train_episode"
# The users' QC_Trainer_v4.train_episode (Jonakss/Atheria, module trainers.qc_trainer_v4 of their
# source tree), the version the integration is checked against.
ATHERIA_DIGESTS = frozenset({"3a2a9567330ed4200e8a753e4356d4702f76866262d987a4629b59b79da8b41a"})


def source_digest(function) -> Optional[str]:
    """sha256 of the function's source lines, stripped, without blank and comment lines; None
    where the source cannot be read."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return None
    lines = (line.strip() for line in source.splitlines())
    return hashlib.sha256("\n".join(line for line in lines if line and not line.startswith("#")).encode()).hexdigest()


def is_stock_episode(function) -> bool:
    if function is StandIn.train_episode:
        return True
    return getattr(function, "__qualname__", None) == STOCK_QUALNAME and source_digest(function) in ATHERIA_DIGESTS


def check_stock_episode(trainer) -> None:
    """Refuse, naming it, a train_episode that is not the stock one."""
    episode = trainer.train_episode
    function = getattr(episode, "__func__", None)
    if getattr(episode, "__self__", None) is trainer and is_stock_episode(function):
        return
    found = function or episode
    name = f"{getattr(found, '__module__', '?')}.{getattr(found, '__qualname__', type(found).__name__)}"
    where = "set on the instance" if "train_episode" in vars(trainer) else "its class's"
    raise TypeError(f"enable(): {type(trainer).__name__}.train_episode is {name} ({where}), not the stock "
                    f"{STOCK_QUALNAME}: enable() replaces train_episode by qca_lowmem's episode, which repeats the "
                    "stock one only, so what this one does differently would be dropped")
