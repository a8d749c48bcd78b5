"""The signals that stop a run: Ctrl-C (SIGINT), a scheduler's preemption (SIGTERM: Slurm,
Kubernetes) and a closed terminal (SIGHUP). Each stops training between optimizer steps with the
progress saved; a step or a save under way finishes first, and a signal after the first is
ignored, so a second Ctrl-C cannot break the save or the exit into a traceback."""

import contextlib
import signal
import threading

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class Stop(KeyboardInterrupt):
    """A stop signal arrived; `status` is the exit status a shell gives for it (128 + number)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.status = 128 + signum


def _stop(signum, frame):
    for other in STOP_SIGNALS:
        if signal.getsignal(other) in (_stop, signal.default_int_handler):
            signal.signal(other, signal.SIG_IGN)
    raise Stop(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def stop_signals_handled(until_exit: bool = False):
    """Within: the stop signals not ignored (nohup ignores SIGHUP) raise Stop, and after the
    first are ignored; the handlers before are restored at the end. The CLI holds it over a whole
    command, its one-line report included. `until_exit` (the command is the process): after a
    stop they stay ignored, since the process is on its way out and a signal during its exit
    would kill it or break the exit into a traceback."""
    if not _in_main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    installed = [number for number, handler in before.items() if handler in (signal.SIG_DFL, signal.default_int_handler)]
    for number in installed:
        signal.signal(number, _stop)
    try:
        yield
    finally:
        stopped = any(signal.getsignal(number) == signal.SIG_IGN for number in installed)
        if not (until_exit and stopped):
            for number, handler in before.items():
                signal.signal(number, handler)


@contextlib.contextmanager
def interrupts_deferred():
    """A stop signal (or a plain Ctrl-C's KeyboardInterrupt) during the block takes effect at its
    end: an optimizer step or a save half done would leave the run inconsistent."""
    if not _in_main_thread():
        yield
        return
    handlers = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    deferred = {s: h for s, h in handlers.items() if h in (_stop, signal.default_int_handler)}
    pending = []
    for number in deferred:
        signal.signal(number, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for number, handler in deferred.items():
            signal.signal(number, handler)
    if pending:
        deferred[pending[0]](pending[0], None)
