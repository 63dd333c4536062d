"""Child processes that die with their parent.

jaxpipe's long-lived children (the server's engine process, the follower that the supervisor
`jaxpipe.process.follower.run` restarts) hold device memory and a place in a JAX cluster. A parent
that exits cleanly stops them first, but one that is SIGKILLed (or crashes) cannot, and the
child would run on. So the parent starts them with `spawn`, which hands the child the read end
of a pipe whose only write end stays in the parent, and the child calls `die_with_parent()`
first thing: a daemon thread blocks reading that pipe. The kernel closes the write end when
the parent process ends, however it ends; the read returns end-of-file and the thread ends
the child with `os._exit` (no cleanup: its main thread may be stuck in a device call or a
collective, and nobody is left to hear from it).

Why a pipe and not Linux's prctl(PR_SET_PDEATHSIG): that signal is sent when the *thread*
that forked the child exits, not the process, and the engine client restarts the engine
from its receiver thread and is built on whichever thread its caller uses. The pipe closes
only when the whole parent is gone, and works on every POSIX system (Linux and macOS alike;
Windows has no `pass_fds`, and jaxpipe's ipc:// sockets need POSIX anyway). It also has no
start-up race: if the parent dies before the child starts watching, the pipe is already at
end-of-file. Its one cost: the watcher needs the GIL for a moment, so a C call that holds
the GIL delays the exit until it returns.
"""

from __future__ import annotations

import os
import subprocess
import threading
import weakref

STABLE_SECONDS = 60.0  # a child up this long has its restart count reset (server, follower)
ENV = "JAXPIPE_LIFELINE_FD"  # the read end's fd number in the child
EXIT_CODE = 1


def spawn(cmd: list[str], **popen_kwargs) -> subprocess.Popen:
    """`subprocess.Popen(cmd, **popen_kwargs)` for a child that calls `die_with_parent()`,
    so that it cannot outlive this process. This end of the pipe is closed when the returned
    handle is collected (subprocess keeps the handle of a running child alive)."""
    read_fd, write_fd = os.pipe()  # both non-inheritable: only pass_fds hands out the read end
    env = dict(popen_kwargs.pop("env", None) or os.environ, **{ENV: str(read_fd)})
    try:
        proc = subprocess.Popen(cmd, pass_fds=(read_fd,), env=env, **popen_kwargs)
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    weakref.finalize(proc, os.close, write_fd)
    return proc


def die_with_parent() -> None:
    """If `spawn` started this process, exit as soon as the parent does; call it first thing.
    A process started any other way (by hand, say) has no parent to die with: no-op."""
    fd = os.environ.pop(ENV, None)  # popped: this process's own children get their own
    if fd is not None:
        threading.Thread(target=_watch, args=(int(fd),), name="lifeline", daemon=True).start()


def _watch(fd: int) -> None:
    while os.read(fd, 1):  # the parent never writes: only end-of-file returns
        pass
    try:
        os.write(2, f"jaxpipe: the parent of process {os.getpid()} exited; exiting\n".encode())
    except OSError:
        pass  # stderr went with the parent
    os._exit(EXIT_CODE)
