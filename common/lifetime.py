"""Children that die with their supervisor: Linux's parent-death signal (prctl PR_SET_PDEATHSIG).

`pagoda up` starts every child in a session of its own (so that Ctrl-C reaches the supervisor alone,
which then stops them in order). If the supervisor itself dies without that chance, by SIGKILL or
the OOM killer, nothing else would stop them: a gateway would go on answering /health for a stack
that no longer exists, holding its port. With this, the kernel sends each child SIGKILL when the
supervisor dies, however it died.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess.Popen: the child gets `sig` when this process dies. None where
    the kernel has no such signal (not Linux). The kernel ties it to the thread that forks, so start
    such children from a thread that lives as long as the process (pagoda up's main thread)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here, not between fork and exec
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:  # the parent died before the prctl: no signal will come
            os._exit(1)

    return preexec
