#!/usr/bin/env python
"""Print the installed distributions whose versions differ from a lock file's pins
(`make test-latest-deps`: what moved since `make lock`).

    python scripts/lock_drift.py requirements/test.lock
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

from packaging.utils import canonicalize_name


def pins(lock: Path) -> dict[str, str]:
    """name -> version of every `name==version` line of a lock."""
    lines = lock.read_text().splitlines()
    found = (re.match(r"^([A-Za-z0-9._-]+)==([^\s;]+)", line) for line in lines)
    return {canonicalize_name(m[1]): m[2] for m in found if m}


def main(lock: str) -> None:
    """One line per pinned distribution installed at another version (or missing)."""
    moved = []
    for name, pinned in sorted(pins(Path(lock)).items()):
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = "not installed"
        if installed != pinned:
            moved.append(f"  {name}: {pinned} (lock) -> {installed}")
    print(f"{len(moved)} of the lock's pins moved:" if moved else f"all of {lock}'s pins hold")
    print("\n".join(moved))


if __name__ == "__main__":
    main(sys.argv[1])
