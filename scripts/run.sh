#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job: `qca-lowmem train` on its embedded default
# (a small CPU config: 30 episodes; its time on a 2-core CPU is in the README). Extra arguments go
# to `train`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTHON=${PYTHON:-python3}
"$PYTHON" -m qca_lowmem train "$@"  # same as the qca-lowmem script, whatever PATH holds
