"""The `qca-lowmem` command (also `python -m qca_lowmem`): train, bench, plan, doctor.

Exit status: 0 done (or nothing to do), 1 a failure while running (the last checkpoint kept), 2 a
bad argument, config, output folder (another run writing there) or checkpoint (found before the
first episode), 3 out of memory (progress saved; before the first episode, nothing ran), 130
Ctrl-C, 143 SIGTERM, 129 SIGHUP (progress saved). Every failure is one line on stderr;
QCA_LOWMEM_TRACEBACK=1 adds the traceback of an unexpected one.
"""

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import List, Optional

from ..recompute.policy import AUTO, MODES, REVOLVE

# --resume alone: the run folder's newest checkpoint (not the checkpoint mode of that name)
RESUME_LATEST = "auto"


def _add_config_options(parser, training: bool):
    parser.add_argument("--config", help="YAML file, or a bundled config by name (default: the embedded small CPU "
                                         "config): default is the full model, small_gpu fits < 4 GiB")
    parser.add_argument("--device", help="auto (default), cpu, cuda, cuda:1, ...")
    parser.add_argument("--grid", type=int)
    parser.add_argument("--d-state", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--qca-steps", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--gamma", type=float, help="the update's decay (GAMMA_DECAY)")
    parser.add_argument("--checkpoint", choices=MODES, help="recompute policy of the lowmem path")
    parser.add_argument("--slots", type=int, help="stored states for --checkpoint revolve")
    parser.add_argument("--budget", help="bytes the episode may keep for --checkpoint auto (e.g. 2GiB; free: the "
                                         "GPU's free memory): full graphs of as many steps as fit, the rest recomputed")
    parser.add_argument("--amp-dtype", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--fused-blocks", action=argparse.BooleanOptionalAction, default=None,
                        help="the U-Net's ConvBlocks as fused kernels (default: the config's; on)")
    parser.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                        help="run each step as replays of captured CUDA graphs (default: the config's; "
                             "unset: on where it can run, CUDA)")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                        help="NHWC from the pack through the U-Net to the update (default: the config's; unset: on "
                             "where it measured faster, a CPU run in fp32 of hidden <= 32)")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: 1 for the embedded config, "
                                                    "else torch's choice; 1 is much faster on a shared CPU)")
    if training:
        parser.add_argument("--episodes", type=int, help="total episodes (a resumed run continues up to this)")
        parser.add_argument("--accumulate", type=int, help="episodes per optimizer step per process")
        parser.add_argument("--seed", type=int)
        parser.add_argument("--max-noise", type=float)
        parser.add_argument("--lr", type=float, help="AdamW's learning rate")
        parser.add_argument("--weight-decay", type=float, help="AdamW's weight decay")
        parser.add_argument("--max-grad-norm", type=float, help="gradient clipping norm")
        parser.add_argument("--max-skipped-steps", type=int,
                            help="optimizer steps skipped in a row (non-finite loss or gradient) before the run stops")
        parser.add_argument("--scheduler", choices=("none", "cosine"), help="learning-rate schedule")
        parser.add_argument("--out", dest="out_dir", help="folder for metrics.csv, checkpoint.pt, tensorboard/")
        parser.add_argument("--save-every", type=int, help="checkpoint every N episodes (0: only at the end)")


EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class _Parser(argparse.ArgumentParser):
    """argparse with its error as one line (the usage is in --help)."""

    def error(self, message):
        self.exit(EXIT_USAGE, one_line(f"{self.prog}: {message} (see {self.prog} --help)") + "\n")


def one_line(text: str) -> str:
    """`text` as one printable line: whitespace runs collapsed, other unprintables escaped (an
    argument or a file's contents may hold anything)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(str(text).split()))


def _flag(name: str) -> str:
    return "--out" if name == "out_dir" else "--" + name.replace("_", "-")


# The config fields with a flag (train has them all; bench and plan those that shape an episode).
CONFIG_FLAGS = ("device", "threads", "grid", "d_state", "hidden", "qca_steps", "batch", "gamma", "checkpoint", "slots",
                "budget", "amp_dtype", "fused_blocks", "cuda_graph", "channels_last", "episodes", "accumulate", "seed",
                "max_noise", "lr", "weight_decay", "max_grad_norm", "max_skipped_steps", "scheduler", "out_dir",
                "save_every")


def _config(args):
    from .config import load_config
    from .errors import UsageError

    overrides = {name: getattr(args, name, None) for name in CONFIG_FLAGS}
    # --slots alone means revolve, --budget alone auto; given with a --checkpoint that takes neither,
    # refused; the config's own, with such a --checkpoint, dropped (they were for its policy).
    if overrides.get("slots") is not None and overrides.get("budget") is not None:
        raise UsageError(f"--slots ({REVOLVE}) and --budget ({AUTO}) are for two policies: give one")
    unset = []
    for option, mode in (("slots", REVOLVE), ("budget", AUTO)):
        checkpoint = overrides.get("checkpoint")
        if overrides.get(option) is not None and checkpoint is None:
            overrides["checkpoint"] = mode
        elif overrides.get(option) is not None and checkpoint != mode:
            raise UsageError(f"{_flag(option)} applies only to --checkpoint {mode}, got --checkpoint {checkpoint}")
        elif checkpoint not in (None, mode):
            unset.append(option)
    return load_config(args.config, flags={name: _flag(name) for name in overrides}, unset=unset, **overrides)


def build_parser():
    parser = _Parser(prog="qca-lowmem", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train the QCA U-Net with the low-memory path")
    _add_config_options(train, training=True)
    train.add_argument("--resume", nargs="?", const=RESUME_LATEST, metavar="CHECKPOINT",
                       help="continue from a checkpoint (default: <out>/checkpoint.pt)")
    train.add_argument("--overwrite", action="store_true",
                       help="start a new run in an --out folder that holds one; its files move to <out>/replaced-<date>/")
    train.add_argument("--stop-after", type=int, metavar="N",
                       help="run at most N episodes now, checkpoint and exit (continue later with --resume)")
    train.add_argument("--ddp", action="store_true", help="under torchrun: split episodes across ranks "
                                                          "(gloo on CPU, NCCL on GPU)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--check", action="store_true", help="check the config, device, output folder, checkpoint "
                                                            "and memory as a run would, then exit without training")

    bench = commands.add_parser("bench", help="stock vs lowmem memory (and time) on the same config")
    _add_config_options(bench, training=False)
    bench.add_argument("--steps", help="comma-separated qca_steps to measure (default: 1/8, 1/4, 1/2, 1 of the config's)")
    bench.add_argument("--repeats", type=int, default=1, help="timed runs per row (median shown), after one "
                                                              "untimed warm-up run of each kind")
    bench.add_argument("--out", default="bench_results", help="folder for bench_<device>.json/.png")

    plan = commands.add_parser("plan", help="predict peak GPU memory and recommend a policy that fits")
    _add_config_options(plan, training=False)
    plan.add_argument("--gpu-mem", required=True, help="GPU memory, e.g. 3.68GiB")
    plan.add_argument("--reserve", default="0.3GiB",
                      help="memory outside PyTorch's allocator (CUDA context); 0 under set_per_process_memory_fraction")
    plan.add_argument("--half", choices=("bf16", "fp16"),
                      help="reduced precision to consider (default: the config's amp_dtype, else bf16; fp16 on "
                           "GPUs without bf16, before Ampere)")
    plan.add_argument("--json", action="store_true")

    commands.add_parser("doctor", help="versions, CUDA kernels, GPU, allocator settings, and what to fix")
    parser.commands = commands.choices
    return parser


def main(argv: Optional[List[str]] = None, *, process: bool = False) -> int:
    """The command `argv` (default: the process's arguments); its exit status. `process`: this
    command is the whole process (entry())."""
    from .signals import stop_signals_handled

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if unknown:  # said by the command's own parser, whose --help lists its flags
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    with stop_signals_handled(until_exit=process) if args.command == "train" else contextlib.nullcontext():
        try:
            return _run(args)
        except SystemExit:
            raise
        except BaseException as error:  # one line for every other way out but success
            status, text = _failure(args.command, error)
            if status == EXIT_FAILED and os.environ.get("QCA_LOWMEM_TRACEBACK"):
                raise
            print(one_line(text), file=sys.stderr, flush=True)
            return status



def entry():
    """The `qca-lowmem` process."""
    sys.exit(main(process=True))

def _failure(command: str, error: BaseException):
    """(exit status, one line) for an exception that ended `command`."""
    from .errors import Interrupted, TrainingStopped, UsageError, error_text
    from .oom import EXIT_OOM, OutOfMemoryStop

    if isinstance(error, KeyboardInterrupt):
        status = getattr(error, "status", EXIT_INTERRUPTED)
        return status, f"qca-lowmem {command}: {error if isinstance(error, Interrupted) else 'interrupted'}"
    if isinstance(error, OutOfMemoryStop):
        return EXIT_OOM, str(error)
    if isinstance(error, TrainingStopped):
        return EXIT_FAILED, f"qca-lowmem {command}: {error}"
    reason = error_text(error)
    # The train command checks before its first episode: a ValueError later is a failure, not bad input.
    if isinstance(error, UsageError) or (command != "train" and isinstance(error, ValueError)):
        return EXIT_USAGE, f"qca-lowmem {command}: {reason}"
    return EXIT_FAILED, (f"qca-lowmem {command}: failed: {type(error).__name__}: {reason} "
                         "(QCA_LOWMEM_TRACEBACK=1 shows where)")


def _run(args) -> int:
    from .train import set_allocator_defaults

    if args.command != "doctor":  # doctor reports the environment as the user set it
        set_allocator_defaults()  # before anything can initialise CUDA
    if args.command == "train":
        return _train(args)
    if args.command == "doctor":
        from .doctor import main_doctor

        return main_doctor()
    config = _config(args)
    if config.threads:  # as train sets it (the embedded config's 1, a YAML's, --threads)
        import torch

        torch.set_num_threads(config.threads)
    if args.command == "bench":
        from .bench import main_bench

        try:
            steps = [int(s) for s in args.steps.split(",")] if args.steps else None
        except ValueError:
            raise ValueError(f"--steps {args.steps}: expected comma-separated integers, e.g. 1,2,4,8") from None
        if args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        return main_bench(config, steps, args.out, args.repeats)
    from .plan import main_plan

    return main_plan(config, args.gpu_mem, args.reserve, args.json, args.half, _train_flags(args),
                     policy_flags_given=any(getattr(args, name) is not None for name in POLICY_FLAGS))


# The options that pick the rollout policy and precision: plan's recommendation spells them out.
POLICY_FLAGS = ("checkpoint", "slots", "budget", "amp_dtype")


def _train_flags(args) -> List[str]:
    """The options `args` gave that `train` reads the same way, the --config as it resolves from
    any folder (a file by its absolute path, a bundled config by name); not the policy's
    (POLICY_FLAGS), which plan's recommendation gives."""
    import shlex

    from .config import config_reference

    flags = ["--config", shlex.quote(config_reference(args.config))] if args.config is not None else []
    for name in (name for name in CONFIG_FLAGS if name not in POLICY_FLAGS):  # those plan's parser has
        value = getattr(args, name, None)
        if isinstance(value, bool):
            flags.append(_flag(name) if value else "--no-" + _flag(name)[2:])
        elif value is not None:
            flags += [_flag(name), shlex.quote(str(value))]
    return flags


def _train(args) -> int:
    import dataclasses

    from .checkpoint import CHECKPOINT_NAME
    from .errors import Interrupted, UsageError
    from .run_checks import check_run, device_note
    from .run_folder import free_run_folder
    from .say import message
    from .train import train

    config = _config(args)
    # No --out and a new run: the next free folder, as run.sh did (under torchrun every rank would
    # pick its own, so there a folder that holds a run is refused with the flags to add).
    if args.out_dir is None and args.resume is None and not args.overwrite and not args.ddp:
        free = free_run_folder(config.out_dir)
        if free != config.out_dir:
            message(f"{config.out_dir} holds a run (--resume continues it): training into {free}")
            config = dataclasses.replace(config, out_dir=free)
    resume = args.resume
    if resume == RESUME_LATEST:
        resume = os.path.join(config.out_dir, CHECKPOINT_NAME)
    elif resume is not None and args.out_dir is None:
        # the run goes on where its checkpoint is, not in the config's folder (which may hold another)
        where = str(Path(resume).parent)
        if os.path.abspath(where) != os.path.abspath(config.out_dir):
            message(f"--resume {resume}: continuing the run in {where}")
            config = dataclasses.replace(config, out_dir=where)
    if args.stop_after is not None and args.stop_after < 1:
        raise UsageError(f"--stop-after must be a positive number of episodes, got {args.stop_after}")
    if args.check:
        check_run(config, resume, create=False, overwrite=args.overwrite)
        print(f"qca-lowmem train: ok: {config.episodes} episodes of {config.qca_steps} steps, grid {config.grid}, "
              f"hidden {config.hidden}, checkpoint={config.checkpoint}, amp_dtype={config.amp_dtype or 'fp32'}, "
              f"out {config.out_dir}, {device_note(config)}")
        return 0
    try:
        results = train(config, resume=resume, ddp=args.ddp, progress=not args.no_progress,
                        stop_after=args.stop_after, overwrite=args.overwrite)
    except Interrupted as stop:
        if not stop.saved:
            raise
        raise Interrupted(f"{stop}; continue with: {resume_command(args, config.out_dir)}", stop.status, True) from None
    if results and int(os.environ.get("RANK", "0")) == 0:
        last = results[-1]
        done = last["episode"] + 1
        ran = (f"{len(results)} episodes" if done >= config.episodes else
               f"stopped early (--stop-after {args.stop_after}) after {len(results)} episodes, at episode {done} "
               f"of {config.episodes}")
        print(f"qca-lowmem train: {ran}, last loss {last['loss']:.4f} (survival {last['survival']:.3f}, "
              f"symmetry {last['symmetry']:.3f}, complexity {last['complexity']:.3f}); metrics in "
              f"{Path(config.out_dir) / 'metrics.csv'}, checkpoint in {Path(config.out_dir) / CHECKPOINT_NAME}"
              + (f"; continue with: {resume_command(args, config.out_dir)}" if done < config.episodes else ""))
    return 0


def resume_command(args, out_dir: str) -> str:
    """The command that continues the run `args` started in `out_dir`: its arguments less
    --stop-after, --overwrite and any --resume, with --out (when it was picked) and --resume."""
    import shlex

    words, given = [], iter(args.argv)
    for word in given:
        if word in ("--stop-after", "--out") or (word == "--resume" and args.resume not in (None, RESUME_LATEST)):
            next(given, None)  # and its value
        elif word.split("=")[0] not in ("--stop-after", "--overwrite", "--resume", "--out"):
            words.append(word)
    head = "qca-lowmem"
    if args.ddp:  # torchrun's own numbers: its processes on this node, and the nodes
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        nodes = f" --nnodes={world // local}" if world != local else ""
        head = f"torchrun{nodes} --nproc_per_node={local} -m qca_lowmem"
    return f"{head} {shlex.join(words)} --out {shlex.quote(str(out_dir))} --resume"


if __name__ == "__main__":
    entry()
