"""The installed distributions whose versions differ from a lock file's pins
(scripts/lock_drift.py, `make test-latest-deps`: what moved since `make lock`)."""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from packaging.utils import canonicalize_name


@dataclass(frozen=True)
class LockDriftConfig:
    """The lock `scripts/lock_drift.py` compares with (its argument, jaxpipe.config.flags).

    lock: the lock file, e.g. requirements/test.lock
    """

    lock: str = field(metadata={"positional": True})


def pins(lock: Path) -> dict[str, str]:
    """name -> version of every `name==version` line of a lock."""
    lines = lock.read_text().splitlines()
    found = (re.match(r"^([A-Za-z0-9._-]+)==([^\s;]+)", line) for line in lines)
    return {canonicalize_name(m[1]): m[2] for m in found if m}


def report(config: LockDriftConfig, log: Callable[[str], None] = print) -> list[str]:
    """One line per pinned distribution installed at another version (or missing), logged
    under a count (or that every pin holds)."""
    moved = []
    for name, pinned in sorted(pins(Path(config.lock)).items()):
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = "not installed"
        if installed != pinned:
            moved.append(f"  {name}: {pinned} (lock) -> {installed}")
    log(f"{len(moved)} of the lock's pins moved:" if moved else
        f"all of {config.lock}'s pins hold")
    log("\n".join(moved))
    return moved
