"""`jaxpipe.serve.programs`: the engine process counts its programs by where they came from,
compiled in the process or loaded from JAX's persistent compilation cache (a loaded one holds
its HLO besides: the restarted engine's extra memory)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Two programs under a persistent cache at argv[1], counted from before the first compile.
SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
from jaxpipe.serve.programs import Programs
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
programs = Programs()
jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3)).block_until_ready()
jax.jit(lambda x: jnp.cos(x) @ x)(jnp.ones((4, 4))).block_until_ready()
print(json.dumps(programs.counts()))
"""


def _counts(cache: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(cache)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env={"PYTHONPATH": str(ROOT),
                                                               "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_a_process_counts_what_it_compiled_and_what_the_next_one_loads(tmp_path):
    first = _counts(tmp_path / "xla")  # an empty cache: everything is compiled
    assert first["compiled"] >= 2 and first["loaded"] == 0
    again = _counts(tmp_path / "xla")  # the same programs: every one from the cache
    assert again == {"compiled": 0, "loaded": first["compiled"]}
