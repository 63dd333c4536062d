"""Request queues, phases and policies. Pure Python: imports neither jax nor numpy.

The policy interface — `SchedulerState`, four actions, `make_policy(...)` with `seesaw`,
`prefill_first`, `decode_first`, `tdpipe` (TD-Pipe) and `throttle` (gLLM) — is what the
engine (jaxpipe/engine/executor.py) and the simulator in `jaxpipe.planner` both drive through one
loop, `loop.py`'s `Driver` (its docstring shows it), each as a `StepExecutor`.
`Sequence` is the engine's record of one request: a `SeqInfo` with its tokens.

The state, by concern: `state.py` (the queues, and the only moves), `device_ledger.py` (the
device store's blocks and slots, over `prefix_cache.py`'s reference-counted `BlockPool`;
`blocks.py` its arithmetic), `host_ledger.py` (the host tier's tokens and the prefix cache's
groups there, `host_prefix.py`), `admission.py` (prefix hits and deferral on entering).
"""

from jaxpipe.scheduler.actions import Action, Kind, Preempt, Run, SwapIn, Switch
from jaxpipe.scheduler.loop import Driver, StepExecutor
from jaxpipe.scheduler.policy import Policy
from jaxpipe.scheduler.registry import POLICIES, make_policy
from jaxpipe.scheduler.seq_info import Location, SeqInfo
from jaxpipe.scheduler.sequence import Sequence
from jaxpipe.scheduler.state import Phase, SchedulerState

__all__ = [
    "Action", "Driver", "Kind", "Location", "POLICIES", "Phase", "Policy", "Preempt", "Run",
    "SchedulerState", "SeqInfo", "Sequence", "StepExecutor", "SwapIn", "Switch", "make_policy",
]
