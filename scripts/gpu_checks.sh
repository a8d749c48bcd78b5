#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in phases, so one device call can run several:
#   bash scripts/gpu_checks.sh build test sanitize bench cap
# build:    pip install with the CUDA kernels (QCA_LOWMEM_CUDA=1: fails loudly if it cannot)
# test:     the whole suite, CUDA variants included
# sanitize: compute-sanitizer memcheck over the CUDA op tests, racecheck over GN+ELU
# bench:    kernels (QCA step, blocks, scaler), episode and plan (plan vs measured peaks);
#           each also a phase of its own; results in benchmarks/results/
# cap:      100 default-config episodes under a 3.68 GiB cap (benchmarks/results/cap_<device>.json)
# cap128:   the small-GPU profile at grid 128 under the same cap, step and revolve (a few episodes)
# PYTEST_ARGS adds arguments to the test phase, SANITIZE_PYTEST_ARGS to memcheck's (`-n 8` with pytest-xdist: a crashing test
# costs its worker, not the run). Phases joined by '+' run at the same time (`test+sanitize`: neither is timed); the others one
# after another. TIMEOUT_<step> (seconds, e.g. TIMEOUT_memcheck=240) bounds one step.
# Logs go to $OUT when set (the device tool's output folder, as one archive with the result
# files), else to /tmp/qca_gpu_logs.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/qca_gpu_logs.XXXX")
export PYTHONUNBUFFERED=1
FAILED="$LOGS/failed"
run() {  # name, command...: run (bounded by TIMEOUT_<name>), log, remember failure, keep going
  local name=$1
  shift
  local limit_var="TIMEOUT_$name"
  local limit=${!limit_var:-0}
  local start=$SECONDS
  echo "=== $name: $*"
  if ! timeout -k 15 "$limit" "$@" >"$LOGS/$name.log" 2>&1; then
    echo "$name" >>"$FAILED"
    echo "=== $name FAILED after $((SECONDS - start)) s; last lines:"
    tail -n 40 "$LOGS/$name.log"
  else
    echo "=== $name passed in $((SECONDS - start)) s; last lines:"
    tail -n 8 "$LOGS/$name.log"
  fi
}
phase() {
  case $1 in
    build) run build env QCA_LOWMEM_CUDA=1 "$PYTHON" -m pip install -v --no-build-isolation --no-deps --force-reinstall . ;;
    test) run test "$PYTHON" -m pytest -q -rs ${PYTEST_ARGS:-} tests ;;
    sanitize)
      # the op tests (workers in parallel: the sanitizer follows child processes)
      run memcheck compute-sanitizer --tool memcheck --error-exitcode 1 "$PYTHON" -m pytest -q ${SANITIZE_PYTEST_ARGS:-} \
        tests/test_qca_step.py tests/test_noise.py tests/test_blocks.py tests/test_scaler.py tests/test_c_api.py -k cuda
      # racecheck is slow: the GN+ELU kernels (the ones sharing memory between threads) on both
      # paths, fp32 and bf16, without the largest shape
      run racecheck compute-sanitizer --tool racecheck --error-exitcode 1 "$PYTHON" -m pytest -q tests/test_blocks.py \
        -k "groupnorm_elu_cuda_is_deterministic or (groupnorm_elu_matches_stock_cuda and (float32 or bfloat16) and not 128)"
      ;;
    bench) phase kernels; phase episode; phase plan ;;
    kernels)
      run bench_qca_step "$PYTHON" benchmarks/bench_qca_step.py
      run bench_block "$PYTHON" benchmarks/bench_block.py
      run bench_scaler "$PYTHON" benchmarks/bench_scaler.py
      ;;
    episode) run bench_episode "$PYTHON" benchmarks/bench_episode.py ;;
    plan) run bench_plan "$PYTHON" benchmarks/bench_plan.py ;;
    cap) run bench_cap "$PYTHON" benchmarks/bench_cap.py ;;
    cap128)
      run cap128_step "$PYTHON" benchmarks/bench_cap.py --config configs/small_gpu.yaml --grid 128 --episodes 5 --name cap128_fp16_step
      run cap128_revolve "$PYTHON" benchmarks/bench_cap.py --config configs/small_gpu.yaml --grid 128 --episodes 5 --checkpoint revolve --slots 32 --name cap128_fp16_revolve32
      ;;
    *) echo "unknown phase: $1 (build, test, sanitize, bench, kernels, episode, plan, cap, cap128)"; exit 2 ;;
  esac
}
echo "=== $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1); $("$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1); $(nproc) CPUs"
for group in "$@"; do
  IFS=+ read -ra parallel <<<"$group"
  if [ ${#parallel[@]} -eq 1 ]; then
    phase "$group"
  else
    for p in "${parallel[@]}"; do phase "$p" & done
    wait
  fi
done
cp benchmarks/results/*.json "$LOGS/" 2>/dev/null
if [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/gpu_checks.tgz" -C "$LOGS" .
fi
if [ -s "$FAILED" ]; then
  echo "=== failed: $(tr '\n' ' ' <"$FAILED")"
  exit 1
fi
echo "=== all phases passed"
