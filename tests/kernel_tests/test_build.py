"""The kernel build cache: processes that need one library at once compile it once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

FAKE_CXX = """#!/bin/sh
# Records its call, takes a while, and writes the file after -o, as a compiler would.
echo called >> "$CALLS"
sleep 1
while [ "$#" -gt 0 ]; do
    if [ "$1" = "-o" ]; then printf 'library' > "$2"; fi
    shift
done
"""

BUILD = ("import sys; from pathlib import Path; from jaxpipe.kernels import build; "
         "print(build.build(Path(sys.argv[1])))")


def test_processes_building_one_library_at_once_compile_it_once(tmp_path):
    cxx = tmp_path / "fake-cxx"
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    source = tmp_path / "src" / "kernel.cc"
    source.parent.mkdir()
    source.write_text("// a kernel\n")
    calls = tmp_path / "calls"
    env = dict(os.environ, CXX=str(cxx), CALLS=str(calls), XDG_CACHE_HOME=str(tmp_path / "c"),
               JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, str(source)], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    paths = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert calls.read_text().splitlines() == ["called"]  # one compile, the others waited
    (path,) = paths
    assert Path(path).read_text() == "library" and Path(path).parent == tmp_path / "c" / \
        "jaxpipe" / "kernels"
