#!/usr/bin/env bash
# Sets up (scripts/setup.sh, with TensorBoard for the run's logs and matplotlib for bench's plot, as
# the README promises) and runs the main job: `qca-lowmem train` on its embedded default (a small
# CPU config: 30 episodes; its time on a 2-core CPU is in the README). Extra arguments go to
# `train`. Without --out each new run trains into the next free folder: runs/qca, then runs/qca-2,
# runs/qca-3, ... (`train` picks it; a folder that holds a run is never overwritten).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh tensorboard matplotlib
PYTHON=${PYTHON:-python3}
"$PYTHON" -m qca_lowmem train "$@"  # same as the qca-lowmem script, whatever PATH holds
