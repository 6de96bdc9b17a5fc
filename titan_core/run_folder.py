"""The run folder (``job.dump_folder``): created and checked up front, and locked while a run writes.

Two runs writing into one folder would overwrite each other's checkpoints and logs. The first
process of a run takes an exclusive ``flock`` on ``<dump_folder>/.titan.lock`` (the kernel drops it
when the process ends, however it ends, so a crashed run leaves no stale lock) and writes its host
and pid there; a second run gets one error naming them.
"""

from __future__ import annotations

import fcntl
import os
import socket
from typing import Any

from titan_core.errors import UsageError

LOCK_NAME = ".titan.lock"


def _folder_problem(path: str, what: str) -> str | None:
    """Why ``path`` cannot be a folder this run writes into, or ``None``."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{what}: {path!r} exists and is not a folder; choose another path"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        return f"{what}: cannot create {path!r} ({exc.strerror}); choose a writable folder"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{what}: {path!r} is not writable; choose a writable folder"
    return None


class RunFolderLock:
    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd: int | None = fd

    @classmethod
    def take(cls, config: Any, topology: Any, *, is_writer: bool) -> RunFolderLock | None:
        """Check the output folders and lock the dump folder (on the run's first process only)."""
        dump = config.job.dump_folder
        problem = _folder_problem(dump, "job.dump_folder")
        if problem is None and config.checkpoint.enable:
            ckpt = os.path.join(dump, config.checkpoint.folder)
            if os.path.exists(ckpt) and not os.path.isdir(ckpt):
                problem = f"checkpoint.folder: {ckpt!r} exists and is not a folder; choose another name"
        if problem:
            raise UsageError(problem)
        if not (is_writer or "pp" in topology.simulated):
            return None
        path = os.path.join(dump, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UsageError(
                f"job.dump_folder {dump!r} is in use by another run ({holder}); wait for it to "
                "end or give this run another job.dump_folder (--dump-folder)"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"host {socket.gethostname()}, pid {os.getpid()}".encode())
        return cls(path, fd)

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
