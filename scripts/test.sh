#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the test suite on TEST_WORKERS processes (pytest-xdist; 2 by
# default, the cores CI has; 0 runs it in this one). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
bash scripts/setup.sh pytest pytest-xdist hypothesis matplotlib uv tensorboard
# One thread per worker where workers fill the cores (torch's default would start one per core in
# each); a test that needs more sets them itself.
[ "${TEST_WORKERS:-2}" = 0 ] || export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$PYTHON" -m pytest -q -n "${TEST_WORKERS:-2}" "$@" tests
