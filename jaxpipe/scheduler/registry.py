"""Policies by name: `make_policy("seesaw" | "prefill_first" | "decode_first" |
"tdpipe" | "throttle", **options)`."""

from __future__ import annotations

from jaxpipe.scheduler.decode_first import DecodeFirst
from jaxpipe.scheduler.policy import Policy
from jaxpipe.scheduler.prefill_first import PrefillFirst
from jaxpipe.scheduler.seesaw import Seesaw
from jaxpipe.scheduler.tdpipe import TDPipe
from jaxpipe.scheduler.throttle import Throttle

POLICIES: dict[str, type[Policy]] = {
    "seesaw": Seesaw, "prefill_first": PrefillFirst, "decode_first": DecodeFirst,
    "tdpipe": TDPipe, "throttle": Throttle}


def make_policy(name: str, **options) -> Policy:
    """A fresh policy by name; `options` go to its constructor (e.g. `chunked=True`)."""
    if name not in POLICIES:
        raise ValueError(f"unknown scheduler policy {name!r}; accepted: {sorted(POLICIES)}")
    return POLICIES[name](**options)
