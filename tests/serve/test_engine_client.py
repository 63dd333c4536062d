"""`EngineClient`'s engine process dies with the front end that started it, SIGKILLed: here
an engine waiting to join a two-process cluster whose follower never comes (so it loads
nothing, and on its own would wait minutes)."""

from __future__ import annotations

import sys

from conftest import assert_child_dies_with_parent

from jaxpipe_bench.multihost import cluster_port

FRONT_END = """
import time
from jaxpipe.serve.engine_client import EngineClient

client = EngineClient({kwargs!r})
time.sleep(300)
"""


def test_the_engine_process_dies_with_its_front_end(tmp_path):
    kwargs = dict(model="smollm2-135m", mesh="cpu-8", coordinator=f"127.0.0.1:{cluster_port()}",
                  num_processes=2, process_id=0, show_progress=False)
    assert_child_dies_with_parent([sys.executable, "-c", FRONT_END.format(kwargs=kwargs)],
                                  tmp_path / "front_end.log")
