"""Cluster settings (EngineConfig's coordinator / num_processes / process_id, JAX's environment
variables) and the leader -> follower mirroring, without starting processes: a fake channel
carries the leader's calls to a follower over recording runners."""

from __future__ import annotations

import pickle

import pytest

from jaxpipe import Engine, EngineConfig
from jaxpipe.config.cluster import Cluster, check_same, cluster_of, shared_fields
from jaxpipe.config.layout import Layout
from jaxpipe.engine.builder import follow
from jaxpipe.runtime import distributed

CLUSTER = dict(mesh="cpu-8", coordinator="127.0.0.1:9876", num_processes=2)


def test_settings_come_from_the_config_or_from_jax_environment_variables(monkeypatch):
    config = EngineConfig(**CLUSTER, process_id=1)
    assert cluster_of(config) == Cluster("127.0.0.1:9876", 2, 1)
    assert cluster_of(config).control_port == 9877
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    config = EngineConfig(mesh="cpu-8")
    assert cluster_of(config) == Cluster("10.0.0.1:1234", 2, 0)
    assert cluster_of(EngineConfig(mesh="cpu-8", process_id=1)).process_id == 1
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two'"):
        EngineConfig(mesh="cpu-8")


def test_one_process_is_no_cluster():
    assert cluster_of(EngineConfig()) is None
    assert cluster_of(EngineConfig(coordinator="h:1", num_processes=1,
                                            process_id=0)) is None


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(coordinator="localhost"), "coordinator must be 'HOST:PORT'"),
    (dict(coordinator="h:65535"), "coordinator must be 'HOST:PORT'"),
    (dict(num_processes=2, process_id=2), r"process_id must be an integer in \[0, 1\]"),
    (dict(num_processes=None), "num_processes must be an integer"),
    (dict(num_processes=3, process_id=0), "8 devices do not split evenly over num_processes=3"),
    (dict(sampler="host", process_id=0), "sampler='host'"),
])
def test_a_bad_cluster_setting_is_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{**CLUSTER, **kwargs})


def test_a_process_count_without_a_coordinator_is_refused():
    with pytest.raises(ValueError, match="need a coordinator"):
        EngineConfig(mesh="cpu-8", num_processes=2, process_id=1)


def test_a_follower_takes_no_requests_and_a_leader_does_not_follow():
    with pytest.raises(ValueError, match="process_id=1 is a follower"):
        Engine(EngineConfig(**CLUSTER, process_id=1))
    with pytest.raises(ValueError, match="follow\\(\\) runs a follower"):
        follow(EngineConfig(**CLUSTER, process_id=0))


def test_settings_that_differ_between_leader_and_follower_are_named():
    leader = shared_fields(EngineConfig(**CLUSTER, process_id=0))
    same = shared_fields(EngineConfig(**CLUSTER, process_id=1, warmup=False))
    check_same(leader, same)  # process_id and warmup may differ
    other = shared_fields(EngineConfig(**CLUSTER, process_id=1, dtype="float32"))
    with pytest.raises(ValueError, match="dtype='float32' \\(leader: 'bfloat16'\\)"):
        check_same(leader, other)


# ---- mirroring ---------------------------------------------------------------------------------


class Recorder:
    """A runner that records its calls; dispatch returns a fresh handle object."""

    def __init__(self):
        self.calls = []
        self.num_blocks = 7
        self.layouts = {"prefill": Layout.parse("pp=8"), "decode": Layout.parse("tp=8")}

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            return Handle(len(self.calls)) if name == "dispatch" else None
        return call


class Handle:
    def __init__(self, n):
        self.n = n


class Wire:
    """The leader's and a follower's channel ends in one: what `send` pickles, `recv` unpickles."""

    def __init__(self):
        self.queue = []

    def send(self, *call):
        self.queue.append(pickle.dumps(call))

    def recv(self):
        return pickle.loads(self.queue.pop(0))

    def close(self):
        pass


def test_the_follower_runs_the_leaders_device_calls_in_order():
    wire, local, remote = Wire(), Recorder(), Recorder()
    mirrored = distributed.MirroredRunner(local, wire)
    first = mirrored.dispatch("inputs0", [0], "plan0")
    second = mirrored.dispatch("inputs1", [0, 1], "plan1", first)
    mirrored.set_phase("decode", [3, 4])
    mirrored.restore_penalties(1, [5], [6])
    assert mirrored.num_blocks == 7  # the rest is the local runner's
    wire.send("swap_out", "r1", [3], 20)
    wire.send("drop", "r1")
    wire.send("close")
    follower = distributed.Follower(remote, wire)
    follower.host.put = lambda *a: remote.calls.append(("host.put", a[:1]))
    follower.host.drop = lambda seq_id: remote.calls.append(("host.drop", (seq_id,)))
    follower.serve()
    names = [name for name, _ in remote.calls]
    assert names == ["dispatch", "dispatch", "set_phase", "restore_penalties", "kv_extract",
                     "host.put", "host.drop", "close"]
    # the second step's `prev` is the follower's own handle of the first step; a follower
    # keeps a step for pp + 1 more (over pp=8 a micro-batch feeds from the one 8 steps back)
    assert remote.calls[1][1][3] is follower.steps[0]
    assert follower.keep == 9
    assert (first.step_id, second.step_id) == (0, 1)
    assert [c[1][:3] for c in remote.calls[:2]] == [c[1][:3] for c in local.calls[:2]]
    assert remote.calls[2] == local.calls[2] == ("set_phase", ("decode", [3, 4]))


def _public_surface(cls) -> set[str]:
    """A class's public methods and properties, and every public attribute its methods set
    on `self` (read statically)."""
    import ast
    import inspect
    import textwrap

    names = {n for n, v in vars(cls).items() if not n.startswith("_")
             and (callable(v) or isinstance(v, property))}
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
              and isinstance(n.value, ast.Name) and n.value.id == "self"
              and isinstance(n.ctx, ast.Store) and not n.attr.startswith("_")}
    return names


def test_the_mirrored_runner_names_every_runner_method_and_attribute():
    """No `__getattr__` forwarding: each public method and attribute of the runner is defined
    on the leader's runner (mirrored to the followers, or read locally), so a new device call
    added to the runner fails here until it is mirrored, rather than silently skipping the
    followers."""
    from jaxpipe.runtime.runner import Runner

    assert "__getattr__" not in vars(distributed.MirroredRunner)
    missing = _public_surface(Runner) - set(vars(distributed.MirroredRunner))
    assert missing == set()


def test_a_runner_method_missing_on_the_mirrored_runner_is_found():
    class Grown:
        def __init__(self):
            self.cache = None

        def dispatch(self):
            pass

        def new_device_call(self):
            pass

    assert _public_surface(Grown) - set(vars(distributed.MirroredRunner)) == {"new_device_call"}
