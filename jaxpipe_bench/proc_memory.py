"""This process's memory as Linux reports it in /proc/self/status: the resident set now
(`VmRSS`), its high-water mark (`VmHWM`, the process's own: getrusage's ru_maxrss keeps a
parent's across an exec, so a child of a large process would report the parent's size), its
private part (`RssAnon`, without mapped files' pages)."""

from __future__ import annotations


def status_bytes(field: str) -> int:
    """The /proc/self/status memory field `field` ("VmRSS", "VmHWM", "RssAnon"), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(f"/proc/self/status has no field {field!r}")
