#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in phases, so that a GPU lent for a few ten-minute commands
# answers the most in the first:
#   bash scripts/gpu_checks.sh build probe test        # first command, about 5 minutes on an H100
#   bash scripts/gpu_checks.sh bench                    # second: kernels, episode, plan
#   bash scripts/gpu_checks.sh sanitize cap             # third
# build:    pip install with the CUDA kernels (QCA_LOWMEM_CUDA=1: fails loudly if it cannot)
# probe:    benchmarks/gpu_probe.py: capture per dtype and layout, the state after a failed
#           capture, forward determinism, GroupNorm at the U-Net's shapes, budget="free", the
#           QCA step's kernels, the pools, the convolutions (2-3 min)
# test:     the tests marked `cuda` (conftest marks every test that runs on a GPU), on
#           TEST_WORKERS workers (pytest-xdist) with a per-test TEST_TIMEOUT (pytest-timeout)
# sanitize: compute-sanitizer memcheck (caching allocator off, so a write into a neighbouring
#           tensor is seen) and initcheck over the CUDA op tests, racecheck over GN+ELU's kernels,
#           both the one-block and the split-group paths
# bench:    kernels (QCA step, blocks, scaler, gradient accumulation), episode and plan (plan vs
#           measured peaks); each also a phase of its own; results in benchmarks/results/
# accumulate: benchmarks/bench_accumulate.py, a step's gradient accumulation against torch's adds
#           (about 10 s)
# users:    the episode rows issue 41 asks for, profiled (kernels and host waits per step, GPU
#           busy): the users' trainer stock and through enable()'s defaults, the captured step
#           NCHW and channels_last (benchmarks/results/episode_users_<device>.json, about 3 minutes)
# peer:     the strongest peer against the users' fix and `LOWMEM: true`, profiled: stock's U-Net
#           through torch.compile (each CUDA mode, the fastest kept), a checkpoint per step, bf16,
#           channels_last (benchmarks/results/episode_peer_<device>.json; bounded at 480 s, so that
#           `build peer` fits a ten-minute command; the peer runs last, its compiles the unknown)
# grids:    the users' fix against `LOWMEM: true` at grid 128 (with stock fp32, which needs about
#           111 GiB) and at grid 256, where the GPU is the bound (episode_grid128/256_<device>.json;
#           each bounded at 240 s)
# overlap:  StepGraph(overlap=True) against one lane: enable()'s defaults, bf16 and fp32
#           channels_last, at grid 64 and (bf16) 128, profiled (episode_overlap_<device>.json, episode_overlap_grid128_<device>.json)
# cap:      100 default-config episodes under a 3.68 GiB cap (benchmarks/results/cap_<device>.json)
# cap128:   the small-GPU profile at grid 128 under the same cap, step and revolve (a few episodes)
# pipeline: the users' own CLI (`python -m src.trainer`) with the README's patch, QCA_LOWMEM=1 then
#           0, grid 128, 500 steps, 3 episodes, each process capped at 3.68 GiB
#           (benchmarks/users_pipeline.py -> users_pipeline_<device>.json; bounded at 300 s). Their
#           checkout must be at atheria/ in this tree (untracked: docs/ci.md, "On a GPU"); without
#           it the step fails saying so
# PYTEST_ARGS adds arguments to the test phase, SANITIZE_PYTEST_ARGS to memcheck's, EPISODE_ARGS
# to bench_episode's, PIPELINE_ARGS to users_pipeline's, PROBE_ARGS to gpu_probe's. Phases joined by '+' run at the same time (`test+sanitize`: neither is
# timed); the others one after another. TIMEOUT_<step> (seconds, e.g. TIMEOUT_memcheck=240)
# bounds one step. After every step the logs and result files so far are packed into
# $OUT/gpu_checks.tgz (the device tool's output folder; else /tmp/qca_gpu_logs.*), so a command
# killed at its time limit still returns all that finished. Without a GPU each phase says what
# it would run and skips.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/qca_gpu_logs.XXXX")
export PYTHONUNBUFFERED=1
FAILED="$LOGS/failed"
GPU=$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
save() {  # pack what is done so far where the caller gets it back, even if a later step is killed
  mkdir -p "$LOGS/results"
  cp benchmarks/results/*.json "$LOGS/results/" 2>/dev/null
  if [ -n "${OUT:-}" ]; then
    tar -czf "$OUT/gpu_checks.tgz.part" -C "$LOGS" . && mv "$OUT/gpu_checks.tgz.part" "$OUT/gpu_checks.tgz"
  fi
}
run() {  # name, command...: run (bounded by TIMEOUT_<name>), log, remember failure, keep going
  local name=$1
  shift
  local limit_var="TIMEOUT_$name"
  local limit=${!limit_var:-0}
  local start=$SECONDS
  echo "=== $name: $*"
  if [ "$GPU" != 1 ]; then
    echo "=== $name skipped: no CUDA GPU"
    return
  fi
  if ! timeout -k 15 "$limit" "$@" >"$LOGS/$name.log" 2>&1; then
    echo "$name" >>"$FAILED"
    echo "=== $name FAILED after $((SECONDS - start)) s; last lines:"
    tail -n 40 "$LOGS/$name.log"
  else
    echo "=== $name passed in $((SECONDS - start)) s; last lines:"
    tail -n 8 "$LOGS/$name.log"
  fi
  save
}
# The peer's compiles (max-autotune autotunes) and the grid-256 episodes have not run on a GPU yet:
# bounded, so that each phase stays under ten minutes.
: "${TIMEOUT_bench_episode_peer:=480}" "${TIMEOUT_bench_episode_grid128:=240}" "${TIMEOUT_bench_episode_grid256:=240}"
# Their pipeline: two runs of at most 120 s each (users_pipeline.py's --timeout), then the kill.
: "${TIMEOUT_pipeline:=300}"
has_module() { "$PYTHON" -c "import $1" 2>/dev/null; }
TEST_ARGS=()  # parallel workers and per-test timeouts where the plugins are installed
has_module xdist && TEST_ARGS+=(-n "${TEST_WORKERS:-8}")
has_module pytest_timeout && TEST_ARGS+=(--timeout "${TEST_TIMEOUT:-300}")
phase() {
  case $1 in
    build) run build env QCA_LOWMEM_CUDA=1 "$PYTHON" -m pip install -v --no-build-isolation --no-deps --force-reinstall . ;;
    probe) run probe "$PYTHON" benchmarks/gpu_probe.py ${PROBE_ARGS:-} ;;
    test) run test "$PYTHON" -m pytest -q -rfEs -m cuda "${TEST_ARGS[@]}" ${PYTEST_ARGS:-} tests ;;
    sanitize)
      # the op tests, without the caching allocator (it would hide writes past a tensor's end
      # inside a larger cached block); workers in parallel: the sanitizer follows child processes
      run memcheck env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
        "$PYTHON" -m pytest -q ${SANITIZE_PYTEST_ARGS:-} \
        tests/ops/test_qca_step.py tests/ops/test_noise.py tests/library/test_blocks.py tests/library/test_scaler_*.py tests/ops/test_c_api.py -m cuda
      # initcheck over our kernels: torch's own (at::native) report reads of memory they allocate
      # themselves (col2im with cuDNN off; a bf16-to-fp32 copy seen once in a comparison and not
      # reproduced in a fresh process, with our U-Net or torch's: docs/benchmarks.md)
      run initcheck compute-sanitizer --tool initcheck --kernel-name-exclude kns=at::native --error-exitcode 1 \
        "$PYTHON" -m pytest -q \
        tests/ops/test_qca_step.py tests/ops/test_noise.py tests/library/test_blocks.py -m cuda -k "not 128"
      # racecheck is slow: the GN+ELU kernels (the ones sharing memory between threads), fp32
      # and bf16, one shape on the one-block path and one on the split-group path
      run racecheck compute-sanitizer --tool racecheck --error-exitcode 1 "$PYTHON" -m pytest -q tests/library/test_blocks.py \
        -k "groupnorm_elu_cuda_is_deterministic or (groupnorm_elu_matches_stock_cuda and (float32 or bfloat16) and not 128)"
      ;;
    bench) phase kernels; phase episode; phase plan ;;
    kernels)
      run bench_qca_step "$PYTHON" benchmarks/bench_qca_step.py
      run bench_block "$PYTHON" benchmarks/bench_block.py
      run bench_scaler "$PYTHON" benchmarks/bench_scaler.py
      phase accumulate
      ;;
    accumulate) run bench_accumulate "$PYTHON" benchmarks/bench_accumulate.py ;;
    # shellcheck disable=SC2086
    episode) run bench_episode "$PYTHON" benchmarks/bench_episode.py ${EPISODE_ARGS:-} ;;
    plan) run bench_plan "$PYTHON" benchmarks/bench_plan.py ;;
    users)
      run bench_episode_users "$PYTHON" benchmarks/bench_episode.py --episodes 2 --profile --profile-steps 50 --runs stock_fp32 \
        stock_fp16_checkpoint stock_v4 lowmem_enable_default lowmem_enable_channels_last lowmem_enable_nchw \
        lowmem_fp32_step_graph lowmem_fp32_step_graph_cl lowmem_bf16_step_graph \
        lowmem_bf16_step_graph_cl lowmem_bf16_step lowmem_bf16_step_cl --name episode_users
      ;;
    peer)
      run bench_episode_peer "$PYTHON" benchmarks/bench_episode.py --episodes 2 --profile --profile-steps 50 --runs stock_fp32 \
        stock_fp16_checkpoint lowmem_enable_default lowmem_enable_channels_last stock_compiled_checkpoint --name episode_peer
      ;;
    grids)
      run bench_episode_grid128 "$PYTHON" benchmarks/bench_episode.py --grid 128 --episodes 2 --skip-grad-check --runs \
        stock_fp32 stock_fp16_checkpoint lowmem_enable_default lowmem_enable_channels_last --name episode_grid128
      run bench_episode_grid256 "$PYTHON" benchmarks/bench_episode.py --grid 256 --episodes 2 --skip-grad-check --runs \
        stock_fp16_checkpoint lowmem_enable_default lowmem_enable_channels_last --name episode_grid256
      ;;
    overlap)
      run bench_episode_overlap "$PYTHON" benchmarks/bench_episode.py --episodes 3 --profile --profile-steps 50 --runs \
        lowmem_enable_default lowmem_enable_default_overlap lowmem_bf16_step_graph_cl lowmem_bf16_step_graph_overlap_cl \
        lowmem_fp32_step_graph_cl lowmem_fp32_step_graph_overlap_cl --name episode_overlap
      run bench_episode_overlap_grid128 "$PYTHON" benchmarks/bench_episode.py --grid 128 --episodes 2 --skip-grad-check \
        --runs lowmem_bf16_step_graph_cl lowmem_bf16_step_graph_overlap_cl --name episode_overlap_grid128
      ;;
    cap) run bench_cap "$PYTHON" benchmarks/bench_cap.py ;;
    cap128)
      run cap128_step "$PYTHON" benchmarks/bench_cap.py --config configs/small_gpu.yaml --grid 128 --episodes 5 --name cap128_fp16_step
      run cap128_revolve "$PYTHON" benchmarks/bench_cap.py --config configs/small_gpu.yaml --grid 128 --episodes 5 --checkpoint revolve --slots 32 --name cap128_fp16_revolve32
      ;;
    # shellcheck disable=SC2086
    pipeline)  # their CLI's own imports (python-dotenv, snntorch) unpacked into atheria/deps (docs/ci.md)
      deps=()
      [ -d atheria/deps ] && deps=(--pythonpath "$PWD/atheria/deps")
      run pipeline "$PYTHON" benchmarks/users_pipeline.py "${deps[@]}" ${PIPELINE_ARGS:-}
      ;;
    *) echo "unknown phase: $1 (build, probe, test, sanitize, bench, kernels, accumulate, episode, plan, users, peer, grids, overlap, pipeline, cap, cap128)"; exit 2 ;;
  esac
}
echo "=== $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -n 1); $("$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1); $(nproc) CPUs; $(git rev-parse --short HEAD 2>/dev/null)"
for group in "$@"; do
  IFS=+ read -ra parallel <<<"$group"
  if [ ${#parallel[@]} -eq 1 ]; then
    phase "$group"
  else
    for p in "${parallel[@]}"; do phase "$p" & done
    wait
  fi
done
save
if [ -s "$FAILED" ]; then
  echo "=== failed: $(tr '\n' ' ' <"$FAILED")"
  exit 1
fi
echo "=== all phases passed"
