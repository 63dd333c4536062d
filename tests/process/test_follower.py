"""The follower supervisor (`python -m jaxpipe.serve --process-id 1`, i.e. `follower.run`),
SIGKILLed, takes its follower process with it: here a follower waiting to join a cluster
whose leader never comes."""

from __future__ import annotations

import sys

from conftest import SERVE_ARGS, assert_child_dies_with_parent

from jaxpipe_bench.multihost import cluster_port


def test_a_killed_supervisor_takes_its_follower_with_it(tmp_path):
    cluster = ["--mesh", "cpu-8", "--coordinator", f"127.0.0.1:{cluster_port()}",
               "--num-processes", "2", "--process-id", "1"]
    assert_child_dies_with_parent([sys.executable, "-m", "jaxpipe.serve", *SERVE_ARGS, *cluster],
                                  tmp_path / "follower.log")
