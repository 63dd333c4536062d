"""Request queues, phases and policies. Pure Python: imports neither jax nor numpy.

The policy interface — `SchedulerState`, four actions, `make_policy(...)` with `seesaw`,
`prefill_first`, `decode_first`, `tdpipe` (TD-Pipe) and `throttle` (gLLM) — is what the
engine (jaxpipe/engine/executor.py) and the simulator in `jaxpipe.planner` both drive through one
loop, `loop.py`'s `Driver` (its docstring shows it), each as a `StepExecutor`.
`Sequence` is the engine's record of one request: a `SeqInfo` with its tokens.

    loop.py           the one loop (`Driver`) over a policy, the state and an executor
    actions.py        what a policy asks for: Run | Switch | SwapIn | Preempt
    policy.py         the policy interface (`Policy`) and the helpers policies share
    registry.py       policies by name (`make_policy`, `POLICIES`)
    seesaw.py         prefill into the host KV tier until it is full, decode out of it
    prefill_first.py  continuous batching with chunked prefill
    decode_first.py   static batching: fill a batch, decode it to the end
    tdpipe.py         TD-Pipe: long prefill and decode phases over pp micro-batches
    predictor.py      tdpipe's output-length predictors
    throttle.py       gLLM: each micro-batch's prompt tokens throttled
    seq_info.py       one request as the scheduler sees it (`SeqInfo`)
    sequence.py       the engine's record of one request (`Sequence`)
    prefix_order.py   the order to queue a known list of prompts in, for the prefix cache

The state, by concern:

    state.py          the queues, and the only moves (`SchedulerState`)
    device_ledger.py  the device store's blocks and slots
    prefix_cache.py   its reference-counted `BlockPool`, caching full blocks by hash
    blocks.py         positions -> blocks: the device ledger's arithmetic
    host_ledger.py    the host tier's tokens, and the prefix cache's groups there
    host_prefix.py    those groups (the prefix cache's second tier)
    admission.py      prefix hits and deferral as waiting sequences enter the device store
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
