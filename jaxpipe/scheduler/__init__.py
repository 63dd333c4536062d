"""Request queues, phases and policies. Pure Python: imports neither jax nor numpy."""

from jaxpipe.scheduler.scheduler import Batch, Scheduler
from jaxpipe.scheduler.sequence import Sequence, SequenceStatus

__all__ = ["Batch", "Scheduler", "Sequence", "SequenceStatus"]
