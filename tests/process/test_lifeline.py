"""`lifeline`: a child started with `spawn` dies when its parent is SIGKILLed, even though the
thread that spawned it ended long before; a child started with plain Popen (the control)
outlives the parent, so the check can fail."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import exited

ROOT = Path(__file__).resolve().parents[2]
CHILD = ("from jaxpipe.process import lifeline; lifeline.die_with_parent(); "
         "import time; time.sleep(300)")
# Spawns one child with the lifeline (from a short-lived thread) and one without, prints
# their pids, then waits to be killed.
PARENT = f"""
import subprocess, sys, threading, time
from jaxpipe.process import lifeline

child = [sys.executable, "-c", {CHILD!r}]
procs = []
spawner = threading.Thread(target=lambda: procs.append(lifeline.spawn(child)))
spawner.start()
spawner.join()
procs.append(subprocess.Popen(child))
print(*(p.pid for p in procs), flush=True)
time.sleep(300)
"""


def test_a_child_dies_with_its_sigkilled_parent():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    held, control = map(int, parent.stdout.readline().split())
    try:
        assert not exited(held, timeout=0), "the child died with the thread that spawned it"
        parent.kill()
        parent.wait()
        assert exited(held), f"child {held} outlived its SIGKILLed parent"
        assert not exited(control, timeout=0), "the control child died too: the check is void"
    finally:
        parent.kill()
        parent.stdout.close()
        for pid in (held, control):
            if not exited(pid, timeout=0):
                os.kill(pid, signal.SIGKILL)

