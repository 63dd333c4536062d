"""Request queues, phases and policies. Pure Python: imports neither jax nor numpy.

Two generations live here. `Scheduler` is the simple slot scheduler the engine uses today
(prefill whenever a slot is free, else decode). The policy interface — `SchedulerState`,
actions, `make_policy(...)` with `seesaw`, `prefill_first`, `decode_first` — is what the
simulator in `jaxpipe.planner` drives and what the engine will move onto; `policy.py`'s
docstring shows the loop an executor runs.
"""

from jaxpipe.scheduler.actions import Action, Kind, Preempt, Run, SwapIn, Switch
from jaxpipe.scheduler.policy import Policy, drive
from jaxpipe.scheduler.registry import POLICIES, make_policy
from jaxpipe.scheduler.scheduler import Batch, Scheduler
from jaxpipe.scheduler.sequence import Sequence, SequenceStatus
from jaxpipe.scheduler.state import Location, Phase, SchedulerState, SeqInfo

__all__ = [
    "Action", "Batch", "Kind", "Location", "POLICIES", "Phase", "Policy", "Preempt", "Run",
    "Scheduler", "SchedulerState", "SeqInfo", "Sequence", "SequenceStatus", "SwapIn", "Switch",
    "drive", "make_policy",
]
