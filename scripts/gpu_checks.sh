#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in phases, so one device call can run several:
#   bash scripts/gpu_checks.sh build test sanitize bench cap
# build:    pip install with the CUDA kernels (QCA_LOWMEM_CUDA=1: fails loudly if it cannot)
# test:     the whole suite, CUDA variants included
# sanitize: compute-sanitizer memcheck over the CUDA op tests, racecheck over GN+ELU
# bench:    kernel, block, scaler, episode and plan-vs-measured benchmarks (benchmarks/results/)
# cap:      100 default-config episodes under a 3.68 GiB cap (benchmarks/results/cap_<device>.json)
# Logs go to $OUT when set (the device tool's output folder), else to /tmp.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LOGS=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
status=0
run() {  # name, command...: run, log, remember failure, keep going
  local name=$1
  shift
  echo "=== $name: $*"
  if ! "$@" 2>&1 | tee "$LOGS/$name.log"; then
    echo "=== $name FAILED"
    status=1
  fi
}
for phase in "$@"; do
  case $phase in
    build) run build env QCA_LOWMEM_CUDA=1 "$PYTHON" -m pip install -q --no-build-isolation --no-deps --force-reinstall . ;;
    test) run test "$PYTHON" -m pytest -q tests ;;
    sanitize)
      run memcheck compute-sanitizer --tool memcheck --error-exitcode 1 "$PYTHON" -m pytest -q -x tests -k cuda
      run racecheck compute-sanitizer --tool racecheck --error-exitcode 1 "$PYTHON" -m pytest -q -x tests/test_blocks.py -k "groupnorm_elu and cuda"
      ;;
    bench)
      run bench_qca_step "$PYTHON" benchmarks/bench_qca_step.py
      run bench_block "$PYTHON" benchmarks/bench_block.py
      run bench_scaler "$PYTHON" benchmarks/bench_scaler.py
      run bench_episode "$PYTHON" benchmarks/bench_episode.py
      run bench_plan "$PYTHON" benchmarks/bench_plan.py
      ;;
    cap) run bench_cap "$PYTHON" benchmarks/bench_cap.py ;;
    *) echo "unknown phase: $phase (build, test, sanitize, bench, cap)"; exit 2 ;;
  esac
done
exit $status
