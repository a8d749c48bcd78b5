"""The `qca-lowmem` command (also `python -m qca_lowmem`): train, bench, plan, doctor."""

import argparse
import os
import sys
from pathlib import Path
from typing import List, Optional


def _add_config_options(parser, training: bool):
    parser.add_argument("--config", help="YAML file, or a bundled config by name (default: the embedded small CPU "
                                         "config): default is the full model, small_gpu fits < 4 GiB")
    parser.add_argument("--device", help="auto (default), cpu, cuda, cuda:1, ...")
    parser.add_argument("--grid", type=int)
    parser.add_argument("--d-state", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--qca-steps", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--checkpoint", choices=("step", "revolve", "none"), help="recompute policy of the lowmem path")
    parser.add_argument("--slots", type=int, help="stored states for --checkpoint revolve")
    parser.add_argument("--amp-dtype", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                        help="on CUDA, run each step as replays of captured CUDA graphs (default: the config's)")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: 1 for the embedded config, "
                                                    "else torch's choice; 1 is much faster on a shared CPU)")
    if training:
        parser.add_argument("--episodes", type=int, help="total episodes (a resumed run continues up to this)")
        parser.add_argument("--accumulate", type=int, help="episodes per optimizer step per process")
        parser.add_argument("--seed", type=int)
        parser.add_argument("--max-noise", type=float)
        parser.add_argument("--out", dest="out_dir", help="folder for metrics.csv, checkpoint.pt, tensorboard/")
        parser.add_argument("--save-every", type=int, help="checkpoint every N episodes (0: only at the end)")


def _config(args):
    from .train import load_config

    overrides = {name: getattr(args, name, None) for name in (
        "device", "threads", "grid", "d_state", "hidden", "qca_steps", "batch", "checkpoint", "slots", "amp_dtype",
        "cuda_graph", "episodes", "accumulate", "seed", "max_noise", "out_dir", "save_every")}
    if overrides.get("slots") is not None and overrides.get("checkpoint") is None:
        overrides["checkpoint"] = "revolve"
    if overrides.get("checkpoint") not in (None, "revolve"):
        overrides["slots"] = None
    return load_config(args.config, **overrides)


def build_parser():
    parser = argparse.ArgumentParser(prog="qca-lowmem", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train the QCA U-Net with the low-memory path")
    _add_config_options(train, training=True)
    train.add_argument("--resume", nargs="?", const="auto", metavar="CHECKPOINT",
                       help="continue from a checkpoint (default: <out>/checkpoint.pt)")
    train.add_argument("--stop-after", type=int, metavar="N",
                       help="run at most N episodes now, checkpoint and exit (continue later with --resume)")
    train.add_argument("--ddp", action="store_true", help="under torchrun: split episodes across ranks "
                                                          "(gloo on CPU, NCCL on GPU)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")

    bench = commands.add_parser("bench", help="stock vs lowmem memory (and time) on the same config")
    _add_config_options(bench, training=False)
    bench.add_argument("--steps", help="comma-separated qca_steps to measure (default: 1/8, 1/4, 1/2, 1 of the config's)")
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument("--out", default="bench_results", help="folder for bench_<device>.json/.png")

    plan = commands.add_parser("plan", help="predict peak GPU memory and recommend a policy that fits")
    _add_config_options(plan, training=False)
    plan.add_argument("--gpu-mem", required=True, help="GPU memory, e.g. 3.68GiB")
    plan.add_argument("--reserve", default="0.3GiB",
                      help="memory outside PyTorch's allocator (CUDA context); 0 under set_per_process_memory_fraction")
    plan.add_argument("--half", choices=("bf16", "fp16"), default="bf16",
                      help="reduced precision to consider (fp16 on GPUs without bf16, before Ampere)")
    plan.add_argument("--json", action="store_true")

    commands.add_parser("doctor", help="versions, CUDA kernels, GPU, allocator settings, and what to fix")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from .train import set_allocator_defaults

    if args.command != "doctor":  # doctor reports the environment as the user set it
        set_allocator_defaults()  # before anything can initialise CUDA
    if getattr(args, "threads", None) and args.command != "train":  # train takes it from its config
        import torch

        torch.set_num_threads(args.threads)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "bench":
            from .bench import main_bench

            steps = [int(s) for s in args.steps.split(",")] if args.steps else None
            return main_bench(_config(args), steps, args.out, args.repeats)
        if args.command == "plan":
            from .plan import main_plan

            return main_plan(_config(args), args.gpu_mem, args.reserve, args.json, args.half)
        from .doctor import main_doctor

        return main_doctor()
    except (ValueError, FileNotFoundError) as error:
        print(f"qca-lowmem {args.command}: {error}", file=sys.stderr)
        return 2


def _train(args) -> int:
    from .oom import EXIT_OOM, OutOfMemoryStop
    from .train import train
    from .train_state import CHECKPOINT_NAME

    config = _config(args)
    resume = args.resume
    if resume == "auto":
        resume = os.path.join(config.out_dir, CHECKPOINT_NAME)
    if resume and not os.path.exists(resume):
        raise FileNotFoundError(f"--resume: no checkpoint at {resume}")
    try:
        results = train(config, resume=resume, ddp=args.ddp, progress=not args.no_progress, stop_after=args.stop_after)
    except OutOfMemoryStop as stop:
        print(stop, file=sys.stderr)
        return EXIT_OOM
    if results and int(os.environ.get("RANK", "0")) == 0:
        last = results[-1]
        print(f"qca-lowmem train: {len(results)} episodes, last loss {last['loss']:.4f} "
              f"(survival {last['survival']:.3f}, symmetry {last['symmetry']:.3f}, complexity {last['complexity']:.3f}); "
              f"metrics in {Path(config.out_dir) / 'metrics.csv'}, checkpoint in {Path(config.out_dir) / CHECKPOINT_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
