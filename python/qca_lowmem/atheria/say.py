"""enable()'s lines (on or off, and how; a trainer left on stock) where the user sees them, once.

Through the `qca_lowmem` logger where logging, as configured, shows the record; otherwise on
stderr. A library warning logged at import (`logging.warning()` at module level) configures the
root logger at WARNING before the program's own `basicConfig(level=INFO)`, which then does
nothing: their pipeline drops every INFO record that way, and a plain interpreter has no
handler at all. A level set on the `qca_lowmem` logger, or `logging.disable()`, is the user's
choice and silences the line. The `qca_lowmem:` prefix is added unless every handler that shows
the record names the logger itself (`%(name)s`), so it is never said twice.
"""

import logging
import re
import sys

log = logging.getLogger("qca_lowmem")

PREFIX = "qca_lowmem: "
_NAMES_LOGGER = re.compile(r"%\(name\)|\{name[}:!]|\$\{?name\b")


def _handlers_showing(logger: logging.Logger, level: int):
    """The handlers a record of `level` from `logger` reaches and passes (propagation included)."""
    found = []
    current = logger
    while current is not None:
        found += [handler for handler in current.handlers if level >= handler.level]
        if not current.propagate:
            break
        current = current.parent
    return found


def _names_logger(handler: logging.Handler) -> bool:
    fmt = getattr(handler.formatter, "_fmt", None)  # no formatter: the message alone
    return bool(fmt) and _NAMES_LOGGER.search(fmt) is not None


def say(level: int, message: str) -> None:
    """One line, seen once: logged where logging shows it, else written to stderr."""
    handlers = _handlers_showing(log, level) if log.isEnabledFor(level) else []
    if handlers:
        prefix = "" if all(_names_logger(h) for h in handlers) else PREFIX
        log.log(level, "%s%s", prefix, message, stacklevel=2)
    elif (log.level == logging.NOTSET or level >= log.level) and logging.root.manager.disable < level:
        print(PREFIX + message, file=sys.stderr, flush=True)
