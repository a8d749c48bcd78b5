"""The errors the trainer application raises and the CLI turns into exit statuses."""


class UsageError(ValueError):
    """A bad config, argument, output folder or checkpoint: found before training starts; the
    CLI exits with status 2."""


def error_text(error: BaseException) -> str:
    """An exception's message on one line, without the C++ stack torch appends to some."""
    return " ".join(str(error).split("Exception raised from ")[0].split()) or type(error).__name__



class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped training; the message says where the progress is."""
