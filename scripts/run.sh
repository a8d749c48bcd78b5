#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job on its embedded default.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
bash scripts/setup.sh
"$PYTHON" benchmarks/bench_qca_step.py "$@"
