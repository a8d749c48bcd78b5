"""PEP 517 backend: setuptools' own, building against the torch of the environment being installed into.

torch is deliberately not a build requirement: `_C` is compiled against torch's C++ ABI, so it must
be built against the very torch it will be imported with, never one a frontend downloads. pip's
default build isolation hides that torch from the build, but pip still runs the build hooks with
the target environment's interpreter: a subprocess of it without pip's isolation variables finds
the target's torch, and that subprocess's sys.path goes at the END of ours, so the build
environment's own setuptools still comes first.
"""

import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

from setuptools import build_meta

# The floors pyproject.toml declares (a test keeps them equal): checked before building, since pip
# would otherwise replace an older torch with the index's newest after building against the old one.
PYTHON_FLOOR = (3, 11)
TORCH_FLOOR = (2, 11)
# What pip's build environment sets to hide the target: PYTHONPATH points at a sitecustomize that
# removes the target's site-packages, PYTHONNOUSERSITE hides the user site. (It also puts its bin
# directory first on PATH and sets PIP_BUILD_TRACKER: neither changes what Python imports.)
ISOLATION_VARIABLES = ("PYTHONPATH", "PYTHONNOUSERSITE")
PROBE = (
    "import importlib.util, json, sys; spec = importlib.util.find_spec('torch'); "
    "print(json.dumps({'torch': spec and spec.origin, 'path': sys.path}))"
)
NO_TORCH = (
    "qca_lowmem builds against the torch installed in your environment and found none: "
    "install torch first, then run this install again (looked in {prefix})"
)
OLD_PYTHON = "qca_lowmem needs Python >= {floor} and this is Python {version} ({python})"
OLD_TORCH = (
    "qca_lowmem needs torch >= {floor} and found torch {version} ({prefix}): install a newer torch built for "
    "your CUDA first (pip would otherwise replace yours with the index's newest), then run this install again"
)
ISOLATED = (
    "qca_lowmem builds against the torch installed in your environment, which this frontend's isolated "
    "build environment ({prefix}) cannot see: install with `pip install .`, or build without isolation: "
    "`python -m build --no-isolation`, `uv build --no-build-isolation`, `uv pip install --no-build-isolation .`, "
    "`pip install --no-build-isolation .`"
)


def _in_frontend_build_venv():
    """The hooks run in a venv a frontend made for this build (`python -m build`: build-env-*, pip's
    venv-isolation feature: pip-build-env-*, uv: builds-v0/*), not in the environment being installed into."""
    prefix = Path(sys.prefix)
    return prefix.name.startswith(("build-env-", "pip-build-env-")) or prefix.parent.name == "builds-v0"


def _floor(version):
    return ".".join(map(str, version))


def use_target_torch():
    if sys.version_info < PYTHON_FLOOR:
        sys.exit(OLD_PYTHON.format(floor=_floor(PYTHON_FLOOR), version=platform.python_version(), python=sys.executable))
    if importlib.util.find_spec("torch") is None:  # else no isolation: setup.py imports the environment's torch
        env = {name: value for name, value in os.environ.items() if name not in ISOLATION_VARIABLES}
        probe = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
        target = json.loads(probe.stdout)
        if target["torch"] is None:
            sys.exit(ISOLATED.format(prefix=sys.prefix) if _in_frontend_build_venv() else NO_TORCH.format(prefix=sys.prefix))
        sys.path.extend(path for path in target["path"] if path and path not in sys.path)
        importlib.invalidate_caches()
    version = importlib.metadata.version("torch")
    if tuple(map(int, re.match(r"(\d+)\.(\d+)", version).groups())) < TORCH_FLOOR:
        sys.exit(OLD_TORCH.format(floor=_floor(TORCH_FLOOR), version=version, prefix=sys.prefix))


def _against_target_torch(hook):
    def run(*args, **kwargs):
        use_target_torch()
        return hook(*args, **kwargs)

    return run


# Every setuptools hook runs setup.py, which imports torch.
get_requires_for_build_wheel = _against_target_torch(build_meta.get_requires_for_build_wheel)
get_requires_for_build_sdist = _against_target_torch(build_meta.get_requires_for_build_sdist)
get_requires_for_build_editable = _against_target_torch(build_meta.get_requires_for_build_editable)
prepare_metadata_for_build_wheel = _against_target_torch(build_meta.prepare_metadata_for_build_wheel)
prepare_metadata_for_build_editable = _against_target_torch(build_meta.prepare_metadata_for_build_editable)
build_wheel = _against_target_torch(build_meta.build_wheel)
build_sdist = _against_target_torch(build_meta.build_sdist)
build_editable = _against_target_torch(build_meta.build_editable)
