#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the test suite on TEST_WORKERS processes (pytest-xdist; 2 by
# default, the cores CI has; 0 runs it in this one). The tests marked xdist_group("inductor") (torch.compile's
# C++ builds) run on one of them, one after another, so each graph is compiled once into the shared cache.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
bash scripts/setup.sh pytest pytest-xdist hypothesis matplotlib uv tensorboard
"$PYTHON" -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadgroup "$@" tests
