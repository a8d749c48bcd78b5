"""Which train_episode enable() may replace: the stock one, whose episode qca_lowmem's repeats
(integration.py). Any other (a subclass's override, a function set on the instance, an edit of
the users' file) does something the library's episode would silently drop, so enable() refuses
it, naming it.

The stock one is a bundled stand-in's (by identity) or the users' QC_Trainer_v4 or QC_Trainer_v3
train_episode, recognised by its source: its lines stripped of indentation, blank and comment lines dropped, must
hash to a version qca_lowmem follows. Reformatting and comments pass; a changed line does not.
"""

import hashlib
import inspect
from typing import Optional

from .examples.qc_trainer_v3 import QC_Trainer_v3 as StandInV3
from .examples.qc_trainer_v4 import QC_Trainer_v4 as StandInV4

STAND_INS = (StandInV4.train_episode, StandInV3.train_episode)
# The users' train_episode of each trainer (Jonakss/Atheria, modules trainers.qc_trainer_v4 and
# trainers.qc_trainer_v3 of their source tree), the versions the integration is checked against.
ATHERIA_DIGESTS = {
    "QC_Trainer_v4.train_episode": frozenset({"3a2a9567330ed4200e8a753e4356d4702f76866262d987a4629b59b79da8b41a"}),
    "QC_Trainer_v3.train_episode": frozenset({"a53075ab0c8272f85c8bf2766e4d40693e877e790fd383d70f99c49a44d7f743"}),
}


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
    if any(function is stand_in for stand_in in STAND_INS):
        return True
    digests = ATHERIA_DIGESTS.get(getattr(function, "__qualname__", None))
    return digests is not None and source_digest(function) in digests


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
                    f"{' or '.join(ATHERIA_DIGESTS)}: enable() replaces train_episode by qca_lowmem's episode, which repeats the "
                    "stock one only, so what this one does differently would be dropped")
