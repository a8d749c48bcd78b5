"""The errors the trainer application raises and the CLI turns into exit statuses."""


class UsageError(ValueError):
    """A bad config, argument, output folder or checkpoint: found before training starts; the
    CLI exits with status 2."""


class TrainingStopped(RuntimeError):
    """Training cannot go on (non-finite steps, a save the disk refused); the message names the
    file, what is kept and what to do. The CLI prints it as is and exits with status 1."""


def error_text(error: BaseException) -> str:
    """An exception's message on one line, without the C++ stack torch appends to some."""
    return " ".join(str(error).split("Exception raised from ")[0].split()) or type(error).__name__



class Interrupted(KeyboardInterrupt):
    """Ctrl-C, SIGTERM or SIGHUP stopped training; the message says where the progress is.
    `status`: the exit status, 128 + the signal's number; `saved`: whether a checkpoint holds the
    progress (so --resume continues it)."""

    def __init__(self, text: str, status: int = 130, saved: bool = False):
        super().__init__(text)
        self.status = status
        self.saved = saved
