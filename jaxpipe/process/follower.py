"""A follower process of a multi-process engine, as the CLIs run it: `python -m jaxpipe.serve`
and `python -m jaxpipe.batch` given `--process-id N` (N > 0) run this instead of their own
work. It follows the leader (`engine.builder.follow`) until the leader closes the engine; when
the cluster fails instead (a process died, so JAX stopped every other one), it rejoins in a
fresh child process, up to `restarts` times in a row, so a leader that restarts finds it again.
The child dies with the supervisor (`lifeline`), so a killed supervisor leaves no follower
behind holding the devices and its place in the cluster.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from jaxpipe.process import lifeline
from jaxpipe.process.lifeline import STABLE_SECONDS  # the server's restart policy, too

log = logging.getLogger("jaxpipe.process.follower")


def run(engine_kwargs: dict, restarts: int = 5, backoff: float = 1.0) -> int:
    """Follow in a child process, rejoining after failures; the exit code of the last one
    (0: the leader closed the engine)."""
    tries = 0
    while True:
        start = time.monotonic()
        code = lifeline.spawn([sys.executable, "-m", "jaxpipe.process.follower",
                               json.dumps(engine_kwargs)]).wait()
        if code == 0:
            return 0
        if time.monotonic() - start >= STABLE_SECONDS:
            tries = 0
        if tries >= restarts:
            log.error("follower exited with code %s; not rejoining (%d rejoins in a row)",
                      code, tries)
            return code
        delay = backoff * 2 ** tries
        tries += 1
        log.warning("follower exited with code %s; rejoining the cluster in %.1f s", code, delay)
        time.sleep(delay)


def main(argv=None) -> int:
    """`python -m jaxpipe.process.follower '{EngineConfig fields as JSON}'`: follow once."""
    lifeline.die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s follower %(levelname)s %(message)s")
    # lazy: the supervisor stays jax-free: only the child (main) builds the engine
    from jaxpipe import EngineConfig
    from jaxpipe.engine.builder import follow

    follow(EngineConfig(**{"show_progress": False, **json.loads(argv[0])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
