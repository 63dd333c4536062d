"""`python -m jaxpipe_peers JOB.json RESULT.json`: run one peer's sweep in this environment.

Exit status 0 with RESULT written, or 1 with the error printed (and no RESULT)."""

from __future__ import annotations

import argparse
import sys
import time

from jaxpipe_peers.protocol import PEERS, read_json, requests_from_json, versions, write_json


def run(job: dict) -> dict:
    """The result of `job`: its peer's sweep, this environment's versions, the wall time."""
    peer = job.get("peer")
    if peer not in PEERS:
        raise ValueError(f"job.peer must be one of {', '.join(PEERS)}, got {peer!r}")
    if peer == "openvino":
        from jaxpipe_peers.openvino import run_job
    elif peer == "llamacpp":
        from jaxpipe_peers.llamacpp import run_job
    else:
        from jaxpipe_peers.hf import run_job
    start = time.perf_counter()
    result = run_job(job, requests_from_json(job["requests"]),
                     requests_from_json(job.get("warmup", [])))
    result.update(versions=versions(), peer_wall_s=time.perf_counter() - start)
    return result


def main(argv: list[str] | None = None) -> int:
    """Parse the two paths, run the job, write the result."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("job", help="the job file the benchmark wrote")
    p.add_argument("result", help="where to write the result")
    args = p.parse_args(argv)
    write_json(run(read_json(args.job)), args.result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
