"""One run per directory: an exclusive lock on ``run_dir`` (and on ``checkpoint.dir``) for the life of a run.

The lock is ``<dir>/.jaxscale.lock``, held with ``flock`` (the kernel lets go of it when the process
ends, however it ends) and holding the holder's ``pid host`` for messages. A second run on the same
directory gets one line naming the first run's process, at once (nothing waits). A lock file that
still names a process but is not locked was left by a run that died (kill -9): it is taken over and
:func:`hold` says so in a warning line. On release the file is emptied; a directory that this run
created (with its parents) and that holds nothing but the lock is removed again (a run refused
before it wrote anything leaves nothing behind). Locks are counted per process, so the command line and
:func:`jaxscale.training.loop.fit` may both hold the same directory. Needs a file system with ``flock``
(local disks, NFSv4, Lustre); this module does not import jax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from jaxscale.config.read import Config, ConfigError, checkpoint_dir

LOCK_FILE = ".jaxscale.lock"


@dataclasses.dataclass
class _Held:
    fd: int
    created: Path | None  # the highest directory of the path this process made, if any
    count: int = 1


_HELD: dict[Path, _Held] = {}


def _holder(text: str) -> str:
    """``process 123 on host`` from a lock file's contents."""
    pid, _, host = text.strip().partition(" ")
    return f"process {pid} on {host or 'an unknown host'}" if pid else "another process"


def _open_locked(path: Path, key: str) -> tuple[int, str]:
    """Lock ``path`` (created if missing); return its descriptor and what it held before."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 256, 0).decode("utf-8", "replace")
            os.close(fd)
            raise ConfigError(
                f"{key} {path.parent} is in use by another run ({_holder(text)}): wait for it to finish, "
                "or choose another directory"
            ) from None
        except OSError:
            os.close(fd)
            raise
        try:
            same = os.fstat(fd).st_ino == path.stat().st_ino  # not a file its holder removed meanwhile
        except FileNotFoundError:
            same = False
        if same:
            return fd, os.pread(fd, 256, 0).decode("utf-8", "replace")
        os.close(fd)


def acquire(directory: str | Path, key: str = "run_dir") -> None:
    """Lock ``directory`` (made if missing) for this process; a :class:`ConfigError` naming ``key`` and the
    holder if another process has it, or if the directory cannot be written."""
    root = Path(directory).absolute()
    if root in _HELD:
        _HELD[root].count += 1
        return
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{key} {root} is a file, not a directory")
    missing = [p for p in (root, *root.parents) if not p.exists()]
    created = missing[-1] if missing else None
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, before = _open_locked(root / LOCK_FILE, key)
    except OSError as e:
        raise ConfigError(f"{key} {root} is not writable: {e.strerror or e}") from e
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        os.fsync(fd)
    except OSError as e:
        os.close(fd)
        raise ConfigError(f"{key} {root} is not writable: {e.strerror or e}") from e
    _HELD[root] = _Held(fd, created)
    if before.strip():
        print(f"jaxscale: warning: {key} {root}: took over the lock of {_holder(before)}, which is no longer "
              "running", file=sys.stderr, flush=True)


def release(directory: str | Path) -> None:
    """Let go of a lock :func:`acquire` took (the last of this process's holds on it)."""
    root = Path(directory).absolute()
    held = _HELD[root]
    held.count -= 1
    if held.count:
        return
    del _HELD[root]
    with contextlib.suppress(OSError):
        os.ftruncate(held.fd, 0)
        if held.created and [p.name for p in root.iterdir()] == [LOCK_FILE]:
            (root / LOCK_FILE).unlink()
            for path in (root, *root.parents):  # up to the highest directory made: each one now empty
                path.rmdir()
                if path == held.created:
                    break
    os.close(held.fd)


@contextlib.contextmanager
def hold(*directories: tuple[str | Path, str]) -> Iterator[None]:
    """Hold the locks of ``(directory, key)`` pairs (the same directory once) inside the block."""
    taken: list[Path] = []
    try:
        for directory, key in directories:
            root = Path(directory).absolute()
            if root in taken:
                continue
            acquire(root, key)
            taken.append(root)
        yield
    finally:
        for root in reversed(taken):
            release(root)


def run_directories(config: Config) -> list[tuple[Path, str]]:
    """What a run of ``config`` writes into and locks: ``run_dir``, and the checkpoint directory when used."""
    dirs = [(Path(config.run_dir).absolute(), "run_dir")]
    ck = config.checkpoint
    if ck.every or ck.continuous or ck.resume != "off":
        dirs.append((checkpoint_dir(config), "checkpoint.dir"))
    if ck.fast_dir:
        dirs.append((Path(ck.fast_dir).absolute(), "checkpoint.fast_dir"))
    return dirs
