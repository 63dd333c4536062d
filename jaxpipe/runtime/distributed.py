"""One engine over several processes: JAX's multi-controller runtime plus the leader's calls
mirrored to the followers.

Every process (one per host) runs `jax.distributed.initialize` against the coordinator
(process 0's `HOST:PORT`; gloo collectives on CPU, NCCL on GPU) and then sees the global
mesh: the devices of all processes, process 0's first. Each process issues the same jitted
programs over that mesh in the same order, and XLA's collectives move the data between them.

Process 0, the leader, runs the scheduler and the front ends. Everything it does on the
devices goes through `MirroredRunner` and the KV manager's mirror hook, which send each call
(the step's ragged batch, block tables and sampling inputs; layout switches; swaps; penalty
state) to the followers over a ZeroMQ control channel on port PORT+1 before running it
locally. A follower (`Follower.serve`) runs the identical call on its own runner: it never
schedules. The host KV tier is split the same way: a swapped-out sequence's arrays are global
arrays, so each process holds (and moves) only its own shards of them. The cluster's
settings (`Cluster`, `cluster_of(config)`: None for one process) are `config/cluster.py`'s.

  initialize(cluster, n, p)  jax.distributed.initialize, n local devices on platform p
  Leader(cluster)            the leader's end of the control channel (send, stats)
  FollowerChannel(cluster)   a follower's end (recv)
  MirroredRunner(runner, leader)   the leader's runner: calls sent, then run locally
  Follower(runner, channel).serve()  a follower's loop, until the leader closes
"""

from __future__ import annotations

import atexit
import itertools
import pickle
import time

import jax
import zmq
from jax._src import distributed as jax_distributed

from jaxpipe.config.cluster import Cluster
from jaxpipe.kv.host_buffer import HostKVBuffer, stage
from jaxpipe.runtime.flow import Pending

CONNECT_SECONDS = 300.0  # how long the leader waits for every follower to say hello
KEEP_STEPS = 4  # dispatched steps a follower keeps for the next step's `prev`, at least: over
# pp stages a micro-batch feeds from the one pp steps before it (`Follower.keep`)
# A process that stops answering JAX's coordination service for this long is declared dead,
# and every other process of the cluster then stops (JAX terminates it): the bound on how
# long a leader can hang in a collective with a dead follower.
HEARTBEAT_SECONDS = 10


class FollowerLost(RuntimeError):
    """A follower process is gone: the engine cannot run another step."""


def initialize(cluster: Cluster, local_devices: int, platform: str) -> None:
    """Join the cluster (before any other JAX use in this process): `local_devices` of
    `platform` each; CPU devices are virtual and talk over gloo."""

    if jax_distributed.global_state.client is not None:
        if (jax.process_count(), jax.process_index()) != (cluster.num_processes,
                                                          cluster.process_id):
            raise RuntimeError(f"this process already joined a cluster as process "
                               f"{jax.process_index()} of {jax.process_count()}")
        return
    if platform == "cpu":
        jax.config.update("jax_num_cpu_devices", local_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(cluster.coordinator, cluster.num_processes, cluster.process_id,
                               heartbeat_timeout_seconds=HEARTBEAT_SECONDS)


# ---- the control channel ---------------------------------------------------------------------


class Leader:
    """Process 0's end: a ROUTER socket every follower's DEALER connects to. `send` pickles a
    call once and queues it to every follower (in order: each follower runs the calls in the
    order they were sent); `stats()` counts messages, bytes and the seconds spent sending."""

    def __init__(self, cluster: Cluster, connect_seconds: float = CONNECT_SECONDS):

        self.cluster = cluster
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never drop a call
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished follower raises
        self._sock.bind(f"tcp://*:{cluster.control_port}")
        self.peers = self._await_followers(connect_seconds)
        self.messages = self.bytes = 0
        self.seconds = 0.0
        self.closed = False
        atexit.register(self._at_exit)

    def _await_followers(self, seconds: float) -> list[bytes]:
        """The followers' identities, once every one has said hello (in process order)."""

        want = set(range(1, self.cluster.num_processes))
        peers: dict[int, bytes] = {}
        deadline = time.monotonic() + seconds
        while set(peers) != want:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000), zmq.POLLIN):
                raise TimeoutError(f"followers {sorted(want - set(peers))} did not connect to "
                                   f"the control channel (port {self.cluster.control_port}) "
                                   f"within {seconds:.0f} s")
            identity, payload = self._sock.recv_multipart()
            peers[pickle.loads(payload)] = identity
        return [peers[i] for i in sorted(peers)]

    def send(self, *call) -> None:
        """Queue `call` (a name and its arguments) to every follower."""

        start = time.perf_counter()
        payload = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        for process, identity in enumerate(self.peers, start=1):
            try:
                self._sock.send_multipart([identity, payload], copy=False)
            except zmq.ZMQError as e:
                raise FollowerLost(f"follower process {process} is gone (control channel: "
                                   f"{e}); the engine cannot step; restart every process "
                                   "of the cluster") from None
        self.messages += 1
        self.bytes += len(payload)
        self.seconds += time.perf_counter() - start

    def stats(self) -> dict:
        """Control messages sent so far: count, bytes (to each follower) and send seconds."""
        return {"control_messages": self.messages, "control_bytes": self.bytes,
                "control_seconds": self.seconds}

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            atexit.unregister(self._at_exit)
            self._sock.close(linger=2000)
            self._ctx.term()

    def _at_exit(self) -> None:
        """An engine left open at exit: tell the followers to close, as JAX's shutdown
        barrier waits for their exit."""
        if not self.closed:
            try:
                self.send("close")
            except FollowerLost:
                pass
            self.close()


class FollowerChannel:
    """A follower's end: says hello with its process id, then receives calls in order."""

    def __init__(self, cluster: Cluster):

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.connect(f"tcp://{cluster.host}:{cluster.control_port}")
        self._sock.send(pickle.dumps(cluster.process_id))

    def recv(self) -> tuple:
        return pickle.loads(self._sock.recv())

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


# ---- mirroring the leader's device work --------------------------------------------------------


def _local(name: str, doc: str = "the local runner's"):
    """A property of `MirroredRunner` reading the local runner's `name`: state or a method
    that touches no device the followers hold (or whose device work the KV manager mirrors)."""
    return property(lambda self: getattr(self._runner, name), doc=f"{name}: {doc}")


class MirroredRunner:
    """The leader's runner: each call that touches the devices is sent to the followers, then
    run on the local runner; everything else is the local runner's, each name listed here (a
    runner method missing here fails `tests/distributed/test_settings.py`, so a new device
    call cannot silently skip the followers). A dispatched step carries `step_id`, by which
    followers find the `prev` of the next."""

    def __init__(self, runner, leader: Leader):
        self._runner, self.leader = runner, leader
        self._steps = itertools.count()

    # The local runner's state and its calls that move no follower's data: swaps go through
    # the KV manager, whose mirror hook sends them; the rest only reads.
    attention = _local("attention")
    buckets = _local("buckets")
    cache = _local("cache")
    compile_seconds = _local("compile_seconds")
    compiled = _local("compiled")
    config = _local("config")
    host_sampler = _local("host_sampler")
    keep_weights = _local("keep_weights")
    kv_chunk = _local("kv_chunk")
    kv_dtype = _local("kv_dtype")
    layouts = _local("layouts")
    max_blocks = _local("max_blocks")
    max_len = _local("max_len")
    num_blocks = _local("num_blocks")
    num_slots = _local("num_slots")
    out_counts = _local("out_counts")
    padding = _local("padding")
    params = _local("params")
    phase = _local("phase")
    placements = _local("placements")
    precision = _local("precision")
    prompt_mask = _local("prompt_mask")
    quant = _local("quant")
    sampler = _local("sampler")
    sampler_threads = _local("sampler_threads")
    layout = _local("layout")
    kernel_choices = _local("kernel_choices")
    kv_extract = _local("kv_extract", "the local runner's (the KV manager mirrors swaps)")
    kv_staging = _local("kv_staging", "the local runner's (the KV manager mirrors swaps)")
    kv_insert = _local("kv_insert", "the local runner's (the KV manager mirrors swaps)")
    lowered = _local("lowered", "the local runner's (inspection only: it runs nothing)")
    ticks = _local("ticks", "the local runner's (counts and records; its idle ticks run through "
                   "drain_one, mirrored)")

    def dispatch(self, inputs, slots, sampling_inputs, prev=None, score=None):
        step = next(self._steps)
        self.leader.send("dispatch", step, inputs, slots, sampling_inputs,
                         getattr(prev, "step_id", None), score)
        out = self._runner.dispatch(inputs, slots, sampling_inputs, prev, score)
        out.step_id = step
        if isinstance(out, Pending):  # its idle ticks run on every process alike
            out.drain = self.drain_one
        return out

    def drain_one(self):
        self.leader.send("drain_one")
        return self._runner.drain_one()

    def hidden(self, inputs):  # no `prev`: only warm-up and timing call it, feeding nothing
        self.leader.send("hidden", inputs)
        return self._runner.hidden(inputs)

    def logits(self, inputs, rows):
        self.leader.send("logits", inputs, rows)
        return self._runner.logits(inputs, rows)

    def logits_many(self, steps):
        self.leader.send("logits_many", steps)
        return self._runner.logits_many(steps)

    def step(self, inputs, slots, sampling_inputs):
        self.leader.send("step", inputs, slots, sampling_inputs)
        return self._runner.step(inputs, slots, sampling_inputs)

    def set_phase(self, phase, live_blocks=None):
        self.leader.send("set_phase", phase, live_blocks)
        return self._runner.set_phase(phase, live_blocks)

    def set_sampler(self, sampler):
        self.leader.send("set_sampler", sampler)
        return self._runner.set_sampler(sampler)

    def restore_penalties(self, slot, prompt, output):
        self.leader.send("restore_penalties", slot, prompt, output)
        return self._runner.restore_penalties(slot, prompt, output)

    def control_stats(self) -> dict:
        """The leader's calls sent to the followers (`Leader.stats`)."""
        return self.leader.stats()

    def close(self):
        self.leader.send("close")
        self._runner.close()
        self.leader.close()


class Follower:
    """A follower process's loop: run each call the leader sends on the local runner, the
    host KV tier's shards kept in `host` (the leader's scheduler state counts its capacity)."""

    def __init__(self, runner, channel: FollowerChannel):

        self.runner, self.channel = runner, channel
        self.host = HostKVBuffer()
        self.steps: dict[int, object] = {}
        self.keep = max(KEEP_STEPS, 1 + max(lay.pp for lay in runner.layouts.values()))

    def serve(self) -> None:
        """Until the leader sends "close" (then the runner is closed too)."""
        try:
            while True:
                name, *args = self.channel.recv()
                if name == "close":
                    self.runner.close()
                    return
                handler = getattr(self, "_" + name, None)
                if handler is not None:
                    handler(*args)
                else:
                    getattr(self.runner, name)(*args)
        finally:
            self.channel.close()

    def _dispatch(self, step, inputs, slots, sampling_inputs, prev, score=None):
        self.steps[step] = self.runner.dispatch(inputs, slots, sampling_inputs,
                                                self.steps.get(prev), score)
        self.steps.pop(step - self.keep, None)

    def _swap_out(self, seq_id, blocks, tokens):
        self.host.put(seq_id, self.runner.kv_extract(blocks, tokens), tokens)

    def _swap_in(self, seq_id, blocks):

        _, staged = stage(self.host, seq_id, self.runner.kv_staging())
        self.runner.kv_insert(blocks, staged)

    def _prefix_fetch(self, key, ids):
        self.runner.kv_insert(ids, self.host.entries[key].arrays)

    def _abort(self, message):
        raise RuntimeError(f"the leader (process 0) failed: {message}")

    def _drop(self, seq_id):
        self.host.drop(seq_id)
