"""The users' own pipeline with the README's patch: their CLI (`python -m src.trainer`), as the
README tells them to run it, with `QCA_LOWMEM=1` and then `QCA_LOWMEM=0` (stock), each in a
process capped at --cap-gib with torch.cuda.set_per_process_memory_fraction.

    python benchmarks/users_pipeline.py [--atheria atheria] [--cap-gib 3.68] [--grid 128]
        [--steps 500] [--episodes 3] [--timeout 120] [--pythonpath DIRS] [--at-peak] [--out FILE]

Their checkout (Jonakss/Atheria at 4df21e7) is not part of this repository. Put it at `atheria/`
in this tree (ignored by git; their `src/` is all the CLI needs):

    git clone https://github.com/Jonakss/Atheria /tmp/Atheria && git -C /tmp/Atheria checkout 4df21e7
    mkdir -p atheria && git -C /tmp/Atheria archive 4df21e7 src | tar -x -C atheria

The checkout is copied to a temporary folder (without its `.git` and `output/`, so an experiment
starts afresh on their V4 trainer), the README's patch saved there as `qca-lowmem.patch` and
applied with `git apply`, and their CLI run in it with `PYTHONPATH=src` (plus --pythonpath, for a
stand-in of a package their CLI imports). benchmarks/pipeline_bootstrap.py caps each run before
their code runs and records the peaks and, for a failure, the exception and where it was raised
(with --at-peak, also what was live at the peak of allocated bytes, by the place that allocated it).
Each run is bounded by --timeout seconds (SIGTERM, then SIGKILL). After every run
benchmarks/results/users_pipeline_<device>.json is rewritten, so a run stopped at a time limit
leaves the ones before it. On a CPU there is no cap: the record says so and the runs go ahead.
The exit status is 1 where the QCA_LOWMEM=1 run did not train every episode saying `qca_lowmem: on`
(stock's outcome, out of memory under the cap at grid 128, is only recorded).
"""

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from common import ROOT, readme_patch, write_result
from pipeline_bootstrap import AT_PEAK_VARIABLE, raise_keyboard_interrupt

PATCHED = "src/pipelines/pipeline_train.py"
THEIR_COMMIT = "4df21e7"
BOOTSTRAP = Path(__file__).resolve().parent / "pipeline_bootstrap.py"
GRACE_S = 10  # after SIGTERM, for their loop's checkpoint and the bootstrap's record
RUNS = {"lowmem": ("QCA_LOWMEM=1", "1"), "stock": ("QCA_LOWMEM=0 (stock)", "0")}


def patched_copy(checkout: Path, into: Path) -> Path:
    """A copy of their checkout with the README's patch applied, as a user applies it."""
    if not (checkout / PATCHED).is_file():
        sys.exit(f"users_pipeline.py: no checkout of Jonakss/Atheria at {checkout} (no {PATCHED}): "
                 f"put theirs there at {THEIR_COMMIT} (see this script's docstring) or pass --atheria PATH")
    if shutil.which("git") is None:
        sys.exit("users_pipeline.py: git is not installed: the README's patch is applied with `git apply`")
    copy = into / "Atheria"
    top = str(checkout)
    shutil.copytree(checkout, copy, ignore=lambda folder, names: [
        n for n in names if n == "__pycache__" or (folder == top and n in (".git", "output"))])
    (copy / "qca-lowmem.patch").write_text(readme_patch(PATCHED))
    done = subprocess.run(["git", "apply", "qca-lowmem.patch"], cwd=copy, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"users_pipeline.py: the README's patch does not apply to {checkout / PATCHED}:\n{done.stderr}")
    return copy


def checkout_commit(checkout: Path):
    """The commit of the checkout's own repository; None for an archive of their src/ (git would
    answer for the tree it sits in, this one)."""
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--show-toplevel", "HEAD"],
                          capture_output=True, text=True)
    found = done.stdout.split()
    if done.returncode != 0 or len(found) != 2 or Path(found[0]).resolve() != checkout.resolve():
        return None
    return found[1]


def their_arguments(args, experiment):
    return ["--experiment_name", experiment, "--model_architecture", "UNET_UNITARY", "--lr_rate_m", "1e-4",
            "--grid_size_training", str(args.grid), "--qca_steps_training", str(args.steps),
            "--total_episodes", str(args.episodes), "--model_params", args.model_params, "--engine_type", "CARTESIAN"]


def episodes_trained(output: str, total: int):
    """(episodes their V4 loop finished, the episodes it logged as failed and skipped), from what it
    prints (at INFO their log is silent: its handler is set up after an import logs). Their loop
    goes on past an episode that raises ("Error en episodio N"), except an out-of-memory error,
    which it logs ("Out of Memory en episodio N") and raises. None where it stopped otherwise."""
    errored = sorted({int(n) for n in re.findall(r"Error en episodio (\d+):", output)})
    if "Entrenamiento completado" in output:
        return total - len(errored), errored
    stopped = re.findall(r"Out of Memory en episodio (\d+)", output)
    if stopped:
        at = int(stopped[-1])
        return at - sum(e < at for e in errored), errored
    return None, errored


def lowmem_line(output: str):
    found = re.search(r"qca_lowmem: (on|off)\b.*", output)
    return found.group(0).strip() if found else None


def stop(proc, why: list):
    """SIGTERM to the run's process group (their loop saves, the bootstrap records), then SIGKILL."""
    why.append(True)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_child(cmd, cwd, env, timeout):
    """(exit status, output, seconds, timed out, interrupted): the output echoed as it comes."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    timed_out, interrupted, lines = [], False, []
    timer = threading.Timer(timeout, stop, [proc, timed_out])
    timer.start()
    try:
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    except KeyboardInterrupt:  # this script's own time limit: end the run, keep its record
        interrupted = True
        stop(proc, [])
        lines.extend(proc.stdout)
    finally:
        timer.cancel()
        proc.wait()
    return proc.returncode, "".join(lines), time.monotonic() - start, bool(timed_out), interrupted


def one_run(args, copy: Path, key: str, scratch: Path):
    name, switch = RUNS[key]
    their_args = their_arguments(args, f"{key}{args.grid}")
    record_path = scratch / f"{key}.json"
    env = {**os.environ, "QCA_LOWMEM": switch,
           "PYTHONPATH": os.pathsep.join(p for p in [args.pythonpath, "src", os.environ.get("PYTHONPATH")] if p),
           # their src/trainer.py sets this before importing torch; the cap's bootstrap starts CUDA before
           # their code runs, so it comes from the environment instead
           "PYTORCH_ALLOC_CONF": "expandable_segments:True", AT_PEAK_VARIABLE: "1" if args.at_peak else "0"}
    cmd = [sys.executable, str(BOOTSTRAP), str(record_path), str(args.cap_gib), "src.trainer", *their_args]
    print(f"=== {name}", flush=True)
    status, output, seconds, timed_out, interrupted = run_child(cmd, copy, env, args.timeout)
    trained, errored = episodes_trained(output, args.episodes)
    run = {"name": name, "command": f"PYTHONPATH=src QCA_LOWMEM={switch} python -m src.trainer {shlex.join(their_args)}",
           "exit": status, "timed_out": timed_out, "interrupted": interrupted, "episodes_trained": trained,
           "episodes_failed_and_skipped": errored, "wall_s_with_startup": round(seconds, 1),
           "line": lowmem_line(output)}
    if record_path.exists():
        run.update(json.loads(record_path.read_text()))
        for kind in ("allocated", "reserved"):
            if f"peak_{kind}_bytes" in run:
                run[f"peak_{kind}_gib"] = round(run[f"peak_{kind}_bytes"] / 2**30, 3)
    else:
        run["record"] = "the bootstrap wrote none: the process was killed before it could"
    run["output_tail"] = output.splitlines()[-25:]
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--atheria", type=Path, default=ROOT / "atheria", help="their checkout (default: atheria/ here)")
    parser.add_argument("--cap-gib", type=float, default=3.68, help="the per-process cap on the GPU, GiB")
    parser.add_argument("--grid", type=int, default=128,
                        help="their --grid_size_training (at 4df21e7 their engine trains at 128 whatever it says)")
    parser.add_argument("--steps", type=int, default=500, help="their --qca_steps_training")
    parser.add_argument("--episodes", type=int, default=3, help="their --total_episodes")
    parser.add_argument("--model-params", default='{"d_state": 14, "hidden_channels": 128}', help="their --model_params")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="in this order")
    parser.add_argument("--timeout", type=float, default=120, help="seconds each run may take")
    parser.add_argument("--pythonpath", default="", help="folders put first on their PYTHONPATH (os.pathsep-separated)")
    parser.add_argument("--at-peak", action="store_true",
                        help="record the GPU allocator's history and say what was live at each run's peak, by place")
    parser.add_argument("--out", default=None, help="result file (default benchmarks/results/users_pipeline_<device>.json)")
    args = parser.parse_args()
    if args.cap_gib <= 0 or args.timeout <= 0:
        parser.error(f"--cap-gib and --timeout must be positive, got {args.cap_gib} and {args.timeout}")
    signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    checkout = args.atheria.resolve()
    payload = {
        "python": sys.version.split()[0],
        "what": "their CLI (python -m src.trainer, Jonakss/Atheria with the README's patch) in a process capped at "
                f"{args.cap_gib} GiB by torch.cuda.set_per_process_memory_fraction"
                + ("" if device.type == "cuda" else " (on a CPU there is no cap: the runs went uncapped)"),
        "checkout_commit": checkout_commit(checkout), "expected_checkout_commit": THEIR_COMMIT,
        "cap_gib": args.cap_gib, "grid": args.grid, "steps": args.steps, "episodes": args.episodes,
        "model_params": json.loads(args.model_params), "timeout_s": args.timeout, "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="qca_users_pipeline_") as scratch:
        copy = patched_copy(checkout, Path(scratch))
        for key in args.runs:
            run = one_run(args, copy, key, Path(scratch))
            payload["runs"].append(run)
            path = write_result("users_pipeline", device, payload, args.out)
            print(f"=== {run['name']}: exit {run['exit']}, {run['episodes_trained']} of {args.episodes} episodes, "
                  f"peak reserved {run.get('peak_reserved_gib')} GiB, {run['wall_s_with_startup']} s -> {path}", flush=True)
            for part in run.get("at_peak", {}).get("by_place", []):
                print(f"    at the peak {part['bytes'] / 2**20:9.1f} MiB from {part['where']}", flush=True)
            if run["interrupted"]:
                sys.exit("users_pipeline.py: stopped by a signal; the runs so far are written")
    lowmem = next((run for run in payload["runs"] if run["name"] == RUNS["lowmem"][0]), None)
    if lowmem and (lowmem["episodes_trained"] != args.episodes or not (lowmem["line"] or "").startswith("qca_lowmem: on")):
        sys.exit(f"users_pipeline.py: with QCA_LOWMEM=1 their pipeline trained {lowmem['episodes_trained']} of "
                 f"{args.episodes} episodes and said {lowmem['line']!r}")


if __name__ == "__main__":
    main()
