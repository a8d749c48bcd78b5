"""Runs a module as `python -m MODULE ARGS...` would, in a process capped on the GPU, and records
at exit (also on an exception or a SIGTERM) what benchmarks/users_pipeline.py reports of it.

    python benchmarks/pipeline_bootstrap.py RECORD.json CAP_GIB MODULE [ARGS...]

Before the module runs, the process is capped at CAP_GIB with
torch.cuda.set_per_process_memory_fraction (a CPU has no such cap: the record says so and the
module runs uncapped). RECORD.json gets the cap, the peak allocated and reserved bytes, and for a
failure the exception's type, first line and the innermost frames that raised it: the innermost
of all, and the innermost in the folder it runs in (the users' code). With QCA_PIPELINE_AT_PEAK=1
in the environment (CUDA only) the allocator's history is recorded and RECORD.json also says what
was live at the peak of allocated bytes, summed by the place that allocated it. Only the standard
library and torch are imported before the module, so the library under test loads as the module
loads it.
"""

import collections
import json
import os
import runpy
import signal
import sys
import traceback


def frame_text(frame, root):
    """'path:line in function: source', the path relative to `root` inside it, else to site-packages."""
    path = frame.filename
    if path.startswith(root + os.sep):
        path = os.path.relpath(path, root)
    elif "site-packages" + os.sep in path:
        path = path.split("site-packages" + os.sep, 1)[1]
    return f"{path}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"


def failure(error, root):
    """The exception's type, first line, and the innermost frames that raised it."""
    # not this file's frames: a SIGTERM raises in its handler, wherever the run was
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename != os.path.abspath(__file__)]
    theirs = [f for f in frames if f.filename.startswith(root + os.sep)]
    return {
        "type": f"{type(error).__module__}.{type(error).__qualname__}".removeprefix("builtins."),
        "message": (str(error).strip().splitlines() or [""])[0][:500],
        "raised_in": frame_text(frames[-1], root) if frames else None,
        "innermost_in_checkout": frame_text(theirs[-1], root) if theirs else None,
    }


def memory(torch, cap_gib):
    """The cap applied (CUDA) or why there is none, and the peaks so far."""
    if not torch.cuda.is_available():
        return {"cap_applied": False, "cap_note": "no CUDA: a CPU process has no memory fraction; ran uncapped"}
    device = torch.cuda.current_device()
    return {
        "cap_applied": True,
        "cap_gib": cap_gib,
        "total_gib": torch.cuda.get_device_properties(device).total_memory / 2**30,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
    }


AT_PEAK_VARIABLE = "QCA_PIPELINE_AT_PEAK"
HISTORY_ENTRIES = 2_000_000  # allocator events kept; a run with more loses its first ones
LIBRARY_FOLDER = os.sep + "qca_lowmem" + os.sep


def place(frames, root):
    """The innermost frame (frames come innermost first) in `root` or in qca_lowmem, as frame_text
    writes it; else "elsewhere"."""
    for frame in frames:
        path = frame["filename"]
        if path.startswith(root + os.sep):
            path = os.path.relpath(path, root)
        elif LIBRARY_FOLDER in path:
            path = "qca_lowmem" + os.sep + path.split(LIBRARY_FOLDER, 1)[1]
        else:
            continue
        return f"{path}:{frame['line']} in {frame['name']}"
    return "elsewhere"


def at_peak(trace, root, top=12):
    """From the allocator's history (torch.cuda.memory._snapshot()'s device trace): the peak of
    allocated bytes, and what was live then summed by `place`, largest first."""
    live, total, peak, peak_index = {}, 0, 0, -1
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event["size"]
            total += event["size"]
            if total > peak:
                peak, peak_index = total, index
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])
    live_then = {}
    for event in trace[:peak_index + 1]:
        if event["action"] == "alloc":
            live_then[event["addr"]] = event
        elif event["action"] == "free_completed":
            live_then.pop(event["addr"], None)
    by_place = collections.Counter()
    for event in live_then.values():
        by_place[place(event["frames"], root)] += event["size"]
    return {"allocated_bytes": peak, "events": len(trace), "history_full": len(trace) >= HISTORY_ENTRIES,
            "by_place": [{"where": where, "bytes": size} for where, size in by_place.most_common(top)]}


def raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main():
    record_path, cap_gib, module = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    import torch

    history = torch.cuda.is_available() and os.environ.get(AT_PEAK_VARIABLE) == "1"
    if torch.cuda.is_available():
        device = torch.cuda.current_device()  # an index: set_per_process_memory_fraction needs one
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total), device)
    if history:
        torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python")
    # a time limit (SIGTERM) ends the run as Ctrl-C would, so the record is still written
    signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
    root = os.getcwd()
    sys.argv = [module, *sys.argv[4:]]
    sys.path[0] = root  # as `python -m` puts it: the current folder, not this script's
    record = {}
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code not in (None, 0):
            record["failure"] = failure(stop, root)
        raise
    except BaseException as error:
        record["failure"] = failure(error, root)
        raise
    finally:
        record.update(memory(torch, cap_gib))
        if history:
            record["at_peak"] = at_peak(torch.cuda.memory._snapshot()["device_traces"][device], root)
        with open(record_path, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
