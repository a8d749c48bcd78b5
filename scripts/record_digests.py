"""Prints the code digests qca_lowmem follows, for the Python running it, as the entry of
`qca_lowmem.atheria.code_identity.FOLLOWED` for that version: the users' own code from an Atheria
checkout (their trainers' episodes, their engine's step, their noise, and the classes of their
model families, "modules"), the stand-ins from qca_lowmem itself. Bytecode differs between Python
minor versions, so each version qca_lowmem recognises the users' code on needs its own entry.

    PYTHONPATH=/path/to/Atheria:/path/to/Atheria/src python scripts/record_digests.py /path/to/Atheria

Their modules are imported, not run (their trainers' imports need python-dotenv and snntorch; their
model files are imported without src/models/__init__.py, which imports SNNUNet's snntorch and torchvision).
"""

import argparse
import importlib
import json
import os
import subprocess
import sys
import types

from qca_lowmem.atheria.code_identity import ATHERIA, FOLLOWED, PYTHON, STAND_IN, class_digest, digest
from qca_lowmem.examples import QC_Trainer_v3, QC_Trainer_v4
from qca_lowmem.examples.qc_trainer_v4 import MemoryMotor, Motor
from qca_lowmem.stock import NoiseInjector

# role -> (their module, their class, the method), in the order FOLLOWED lists them
THEIRS = {
    "QC_Trainer_v4.train_episode": ("src.trainers.qc_trainer_v4", "QC_Trainer_v4", "src/trainers/qc_trainer_v4.py"),
    "QC_Trainer_v3.train_episode": ("src.trainers.qc_trainer_v3", "QC_Trainer_v3", "src/trainers/qc_trainer_v3.py"),
    "CartesianEngine.evolve_step": ("src.engines.qca_engine", "CartesianEngine", "src/engines/qca_engine.py"),
    "CartesianEngine._evolve_logic": ("src.engines.qca_engine", "CartesianEngine", "src/engines/qca_engine.py"),
    "QuantumNoiseInjector.apply_phase_flip": ("src.physics.noise", "QuantumNoiseInjector", "src/physics/noise.py"),
    "QuantumNoiseInjector.apply_bit_flip": ("src.physics.noise", "QuantumNoiseInjector", "src/physics/noise.py"),
}
# Their model families' classes whose code a call runs, by file. Not recorded: their ConvBlocks (a call
# of one is stock's, `return self.conv_block(x)`, which qca_lowmem reads off its code on any Python) and
# SNNUNet (its snntorch neurons are code qca_lowmem does not follow, so it is never followed whole).
THEIR_MODULES = {
    "src/models/unet.py": ["UNet"],
    "src/models/unet_unitary.py": ["UNetUnitary"],
    "src/models/unet_unitary_rmsnorm.py": ["UNetUnitaryRMSNorm"],
    "src/models/rmsnorm.py": ["RMSNorm2d"],
    "src/models/mlp.py": ["MLP"],
    "src/models/deep_qca.py": ["DeepQCA"],
    "src/models/unet_convlstm.py": ["UNetConvLSTM"],
}
STOCK = "qca_lowmem/stock.py NoiseInjector."
OURS = {
    "QC_Trainer_v4.train_episode": [(QC_Trainer_v4.train_episode, STAND_IN + "qc_trainer_v4.py")],
    "QC_Trainer_v3.train_episode": [(QC_Trainer_v3.train_episode, STAND_IN + "qc_trainer_v3.py")],
    "Motor.evolve_step": [(Motor.evolve_step, STAND_IN + "qc_trainer_v4.py Motor"),
                          (MemoryMotor.evolve_step, STAND_IN + "qc_trainer_v4.py MemoryMotor")],
    "QuantumNoiseInjector.apply_phase_flip": [(NoiseInjector.apply_phase_flip, STOCK + "apply_phase_flip")],
    "QuantumNoiseInjector.apply_bit_flip": [(NoiseInjector.apply_bit_flip, STOCK + "apply_bit_flip")],
}


def their_model_file(checkout: str, path: str):
    """Their model file `path` imported as src.models.<name>, without src/models/__init__.py."""
    for package, folder in (("src", "src"), ("src.models", "src/models")):
        if package not in sys.modules:
            module = types.ModuleType(package)
            module.__path__ = [os.path.join(checkout, folder)]
            sys.modules[package] = module
    return importlib.import_module("src.models." + os.path.splitext(os.path.basename(path))[0])


def recorded(checkout: str) -> dict:
    commit = subprocess.run(["git", "-C", checkout, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip() if os.path.isdir(os.path.join(checkout, ".git")) else ""
    if commit and not ATHERIA.endswith(f"at {commit}, "):
        sys.exit(f"record_digests: the checkout is at {commit}, code_identity.ATHERIA names another commit: {ATHERIA!r}")
    entry = {}
    for role in [*THEIRS, *(r for r in OURS if r not in THEIRS)]:
        known = entry.setdefault(role, {})
        if role in THEIRS:
            module, cls, path = THEIRS[role]
            function = getattr(getattr(importlib.import_module(module), cls), role.split(".")[1])
            known[digest(function)] = ATHERIA + path
        for function, origin in OURS.get(role, ()):
            known[digest(function)] = origin
        if None in known:
            sys.exit(f"record_digests: {role}: a function could not be digested")
    modules = entry["modules"] = {}
    for path, classes in THEIR_MODULES.items():
        for name in classes:
            found = class_digest(getattr(their_model_file(checkout, path), name))
            if found is None:
                sys.exit(f"record_digests: {path} {name}: its code could not be digested")
            # Classes of the same code share a digest (UNetUnitary and UNetUnitaryRMSNorm): one entry names each.
            modules[found] = f"{modules[found]}, {path} {name}" if found in modules else f"{ATHERIA}{path} {name}"
    return entry


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("checkout", help="an Atheria checkout at the commit code_identity.ATHERIA names")
    entry = recorded(parser.parse_args().checkout)
    print(json.dumps({PYTHON: entry}, indent=4))
    if PYTHON in FOLLOWED:
        print(f"# {'the same as' if FOLLOWED[PYTHON] == entry else 'DIFFERS from'} FOLLOWED[{PYTHON!r}]")


if __name__ == "__main__":
    main()
