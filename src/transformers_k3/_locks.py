"""Advisory file locks and process liveness, for the kernel build and the converters' outputs alike."""

from __future__ import annotations

import os

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None


def try_flock(path):
    """An open file holding an exclusive ``flock`` on ``path``, or None if another process holds it (or there is no
    ``flock`` on this platform: see `fcntl`)."""
    if fcntl is None:  # pragma: no cover - non-POSIX
        return None
    handle = open(path, "a+b")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return None
    return handle


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
