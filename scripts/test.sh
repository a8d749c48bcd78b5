#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
bash scripts/setup.sh pytest hypothesis matplotlib uv tensorboard
"$PYTHON" -m pytest -q "$@" tests
