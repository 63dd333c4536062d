"""Where jaxpipe keeps what it builds or measures once per machine: `$XDG_CACHE_HOME/jaxpipe/`,
`~/.cache/jaxpipe/` when that is unset or empty, one subdirectory per kind (`xla` compiled
programs, `kernels` C++ kernels, `kernel_choice` kernel timings, `timing` TD-Pipe step times).
`jaxpipe_peers` keeps its own copy of the rule: it imports nothing from jaxpipe."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """jaxpipe's cache directory, or the subdirectory `parts` of it (not created here)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base, "jaxpipe", *parts)
