"""Runs tests/multidevice/ in a child pytest process with 8 virtual CPU devices (JAX fixes the
device count when its backend starts, and this process runs on one device)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


@pytest.mark.slow
def test_multidevice_suite():
    env = dict(os.environ, JAXPIPE_MULTIDEVICE="1",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                         "--xla_force_host_platform_device_count=8".strip())
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           str(TESTS / "multidevice")], cwd=TESTS.parent, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    # A child that skipped its tests (too few devices, no weights) must not pass for a run.
    summary = proc.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed[1]) > 0 and "skipped" not in summary, summary
