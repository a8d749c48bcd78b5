"""Examples that ship with the package, so that the README's snippets run as pasted (plain torch,
qca_lowmem.stock only):

- `qc_trainer_v4`: a stand-in for the users' QC_Trainer_v4, its engine and config.
- `qc_trainer_v3`: a stand-in for their QC_Trainer_v3.
"""

from .qc_trainer_v3 import QC_Trainer_v3
from .qc_trainer_v4 import Motor, QC_Trainer_v4, QuantumState, make_config

__all__ = ["Motor", "QC_Trainer_v3", "QC_Trainer_v4", "QuantumState", "make_config"]
