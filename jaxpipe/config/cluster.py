"""The processes of one engine, as its config names them: a coordinator (process 0's
`HOST:PORT`), how many processes, this one's index; JAX's environment variables fill those not
given. `cluster_of(config)` is the `Cluster` of an EngineConfig (None: one process); the checks
refuse an impossible cluster and a follower whose settings differ from the leader's. Joining
the cluster and the control channel are `runtime/distributed.py`'s.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}


@dataclass(frozen=True)
class Cluster:
    """Where process `process_id` of `num_processes` finds the coordinator (`host:port`)."""

    coordinator: str
    num_processes: int
    process_id: int

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def host(self) -> str:
        return self.coordinator.rsplit(":", 1)[0]

    @property
    def control_port(self) -> int:
        """The control channel's port: the coordinator's plus one."""
        return int(self.coordinator.rsplit(":", 1)[1]) + 1


def settings(coordinator, num_processes, process_id) -> tuple:
    """The three settings with JAX's environment variables filling those not given."""
    values = {"coordinator": coordinator, "num_processes": num_processes,
              "process_id": process_id}
    for name, var in ENV.items():
        if values[name] is None and os.environ.get(var):
            raw = os.environ[var]
            values[name] = raw if name == "coordinator" else _int_env(var, raw)
    return values["coordinator"], values["num_processes"], values["process_id"]


def _int_env(var: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {var}={raw!r} must be an integer") from None


def check(coordinator, num_processes, process_id, num_devices: int, sampler: str) -> None:
    """Raise ValueError naming the setting unless the three describe a valid cluster (or
    none: all None, or one process)."""
    if coordinator is None:
        if (num_processes or 1) > 1 or process_id not in (None, 0):
            raise ValueError(f"EngineConfig.num_processes={num_processes} / process_id="
                             f"{process_id} need a coordinator ('HOST:PORT' of process 0)")
        return
    host, _, port = str(coordinator).rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65534:
        raise ValueError(f"EngineConfig.coordinator must be 'HOST:PORT' with a port in "
                         f"[1, 65534] (the control channel uses PORT+1), got {coordinator!r}")
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or not (
            1 <= num_processes <= 1024):
        raise ValueError(f"EngineConfig.num_processes must be an integer in [1, 1024] with a "
                         f"coordinator, got {num_processes!r}")
    if isinstance(process_id, bool) or not isinstance(process_id, int) or not (
            0 <= process_id < num_processes):
        raise ValueError(f"EngineConfig.process_id must be an integer in [0, "
                         f"{num_processes - 1}], got {process_id!r}")
    if num_devices % num_processes:
        raise ValueError(f"the mesh's {num_devices} devices do not split evenly over "
                         f"num_processes={num_processes}")
    if num_processes > 1 and sampler != "device":
        raise ValueError(f"EngineConfig.sampler={sampler!r}: several processes sample on the "
                         "device only (sampler='device')")


# EngineConfig fields that may differ between the processes of one cluster.
LOCAL_FIELDS = frozenset({"process_id", "show_progress", "compilation_cache_dir", "warmup"})


def shared_fields(config) -> dict:
    """The EngineConfig fields every process of a cluster must agree on."""

    return {f.name: str(getattr(config, f.name)) for f in dataclasses.fields(config)
            if f.name not in LOCAL_FIELDS}


def check_same(leader: dict, mine: dict) -> None:
    """Raise ValueError naming every field where this follower's config differs from the
    leader's (the processes would run different programs)."""
    differ = [f"{k}={mine.get(k)!r} (leader: {v!r})" for k, v in leader.items()
              if mine.get(k) != v]
    if differ:
        raise ValueError("this follower's EngineConfig differs from the leader's: "
                         + ", ".join(differ) + "; start every process with the same settings")


def cluster_of(config) -> Cluster | None:
    """The cluster an EngineConfig describes; None for one process."""
    if config.coordinator is None or config.num_processes == 1:
        return None
    return Cluster(config.coordinator, config.num_processes, config.process_id)


