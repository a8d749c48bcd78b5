"""One writer per output folder: `train` holds an OS file lock (flock) on <out>/.qca-lowmem.lock
for its life. The kernel drops the lock when the process ends, however it ends, so a killed run
never leaves a stale one; a clean end removes the file."""

import errno
import os
from pathlib import Path
from typing import Optional

from .errors import UsageError
from .say import message

LOCK_NAME = ".qca-lowmem.lock"


class FolderLock:
    def __init__(self, folder):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.fd: Optional[int] = None

    def acquire(self):
        """Hold the lock, or raise UsageError naming the PID that holds it. Where the filesystem
        has no locks, say so and go on unlocked."""
        import fcntl

        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() if error.errno in _HELD else None
                os.close(fd)
                if holder is None:
                    message(f"warning: cannot lock {self.path} ({error.strerror}): make sure no other run "
                            f"writes to {self.folder}")
                    return
                raise UsageError(f"--out {self.folder}: another qca-lowmem train (PID {holder or 'not yet written'}) "
                                 f"is writing there; wait for it to end, or use another --out") from None
            # The holder before us may have removed the file after we opened it: lock the one there.
            if _same_file(fd, self.path):
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self):
        """Remove the file, then drop the lock (in that order: a run waiting on this file then
        sees it gone and locks a new one)."""
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None


_HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


def _same_file(fd: int, path: Path) -> bool:
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)
