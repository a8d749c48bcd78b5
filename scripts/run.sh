#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job: `qca-lowmem train` on its embedded default
# (a small CPU config: 30 episodes; its time on a 2-core CPU is in the README). Extra arguments go
# to `train`. Without --out, --config, --resume or --overwrite each run trains into a new folder:
# runs/qca, then runs/qca-2, runs/qca-3, ... (a folder that holds a run is never overwritten).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTHON=${PYTHON:-python3}
out=()
chosen=1
for arg in "$@"; do
  case "$arg" in
    --out|--out=*|--config|--config=*|--resume|--resume=*|--overwrite) chosen=0 ;;
  esac
done
if [ "$chosen" = 1 ]; then
  folder=runs/qca
  n=1
  while [ -e "$folder/checkpoint.pt" ] || [ -e "$folder/metrics.csv" ]; do
    n=$((n + 1))
    folder="runs/qca-$n"
  done
  echo "run.sh: training into $folder"
  out=(--out "$folder")
fi
"$PYTHON" -m qca_lowmem train "${out[@]}" "$@"  # same as the qca-lowmem script, whatever PATH holds
