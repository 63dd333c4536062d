"""`python -m jaxpipe.batch INPUT.jsonl -o OUTPUT.jsonl`: an offline batch job in OpenAI's batch
format, in-process or against a server. See `--help` and README "Batch jobs"."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxpipe.batch.job import BatchJobConfig
from jaxpipe.config.engine import EngineConfig
from jaxpipe.config.flags import add_flags, config_from_args, config_kwargs

EPILOG = """\
Input lines: {"custom_id": "...", "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body": {...}}. Output lines: {"id", "custom_id", "response": {...},
"error": null} or an error record ("response": null, "error": {"code", "message", "param"}).
Records are appended and flushed as requests finish. Re-running the same command after an
interruption (Ctrl-C, kill -9) skips every custom_id already in the output.

examples:
  python -m jaxpipe.batch requests.jsonl -o results.jsonl --dtype float32
  python -m jaxpipe.batch requests.jsonl -o results.jsonl --server 127.0.0.1:50051
  two processes (README "Several hosts"): the same command on each, plus
    --mesh cpu-8 --coordinator 127.0.0.1:9876 --num-processes 2 --process-id 0   (or 1)
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxpipe.batch", epilog=EPILOG,
                                description="Run an OpenAI-format JSONL batch job with jaxpipe.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", metavar="INPUT.jsonl", help="requests, one JSON object per line")
    p.add_argument("-o", "--output", required=True, metavar="OUTPUT.jsonl",
                   help="results; appended to, so an interrupted job resumes")
    add_flags(p, BatchJobConfig, group="job")
    # show_progress: the job's own bar (--no-progress); the engine's stays off (LocalRunner)
    add_flags(p, EngineConfig, group="engine", skip=("show_progress",))
    return p


def _runner(job: BatchJobConfig, engine: dict):
    # lazy: --help and bad arguments answer without loading jax
    from jaxpipe.batch.runners import LocalRunner, RemoteRunner

    if job.server:
        return RemoteRunner(job.server, job.max_in_flight)
    return LocalRunner.from_config(engine, job.max_in_flight, job.prefix_lookahead)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = config_from_args(BatchJobConfig, args, parser)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    kwargs = config_kwargs(EngineConfig, args)
    if not config.server and config_from_args(EngineConfig, args, parser).process_id:
        # lazy: a follower process (--process-id) needs neither the job nor its runners
        from jaxpipe.process import follower

        return follower.run(kwargs, restarts=0)  # the leader's job reads and writes the files
    # lazy: --help and bad arguments answer without loading jax
    from jaxpipe.batch.job import Job
    from jaxpipe.batch.runners import ServerError
    from jaxpipe.runtime.distributed import FollowerLost

    job = Job(args.input, args.output, config.max_line_bytes, progress=config.progress,
              tool_call_parser=config.tool_call_parser)
    try:
        job.run(_runner(config, kwargs))
    except (ServerError, FollowerLost) as e:
        print(f"jaxpipe.batch: {e}\njaxpipe.batch: stopped; re-run the same command to resume",
              file=sys.stderr)
        if isinstance(e, FollowerLost):  # JAX's exit barrier would wait for the lost process
            print(job.summary.text(args.output), file=sys.stderr, flush=True)
            os._exit(1)
        return 1
    except KeyboardInterrupt:
        print("\njaxpipe.batch: interrupted; re-run the same command to resume", file=sys.stderr)
        return 130
    finally:
        print(job.summary.text(args.output), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
