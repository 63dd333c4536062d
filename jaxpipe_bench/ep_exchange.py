"""One MoE layer under expert parallelism, its exchange two ways, on an `ep` mesh
(scripts/bench_ep_exchange.py):

  - "psum" (the engine's, `decoder._moe_mlp` with `pipeline.expert_shard`): every device
    holds all T tokens [T, E] (attention replicated over ep), routes them, runs its own X/ep
    experts on the tokens routed to them (`decoder.local_experts`: other shards' choices get
    an out-of-range id the experts skip), and one `psum` over ep sums the [T, E] f32
    partial outputs: every device ends with all T rows.
  - "a2a": the tokens split over ep (data-parallel attention, T/ep rows a device); each
    device routes its rows, `lax.all_to_all` sends each (token, expert) pair's row to the
    device holding the expert, that device runs its experts on what it received, a second
    all_to_all returns the products, and each device sums its rows' k weighted products:
    every device ends with its T/ep rows.

Both run the engine's router (`moe.route`) and experts (`moe.experts_mlp`) on the same
weights, so their outputs agree (checked in `measure`) and the timings compare equal work.
The all-to-all's buffers have static shapes: `capacity` rows per (source, destination)
pair. None: T/ep * k, the most a device can send one destination, so nothing is ever dropped
(ep times the average traffic under balanced routing); a smaller capacity drops the pairs
past it (their products count 0: `dropped` counts them, and outputs then differ).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpipe.config.checks import check_choices, check_counts
from jaxpipe.model import decoder, moe
from jaxpipe_bench.checkpoint import QWEN3_MOE_1B
from jaxpipe_bench.cli import check_sizes

TOKENS: tuple[int, ...] = (8, 64, 512)
EP = 8
# The 1B Qwen3-MoE checkpoint's layer (`scripts/make_checkpoint.py --family qwen3_moe`).
SHAPE = {"experts": QWEN3_MOE_1B["num_experts"], "k": QWEN3_MOE_1B["num_experts_per_tok"],
         "hidden": QWEN3_MOE_1B["hidden_size"], "width": QWEN3_MOE_1B["moe_intermediate_size"]}
WAYS = ("psum", "a2a")


@dataclass(frozen=True)
class EpExchangeConfig:
    """What `scripts/bench_ep_exchange.py` times (its flags, jaxpipe.config.flags).

    tokens: the token counts T (each a multiple of ep)
    ep: expert shards (devices used)
    rounds: interleaved rounds of each point (the median is kept)
    path: the experts' path (none: grouped where its kernel builds, else dense)
    capacity_factor: all-to-all buffer rows at this multiple of the balanced share (pairs past
        it dropped); none: no drop
    json_path: write the points here, with the machine (none: only the table)
    """

    tokens: tuple[int, ...] = TOKENS
    ep: int = EP
    rounds: int = 7
    path: Literal["grouped", "dense", "ragged"] | None = None
    capacity_factor: float | None = None
    json_path: str | None = field(default=None, metadata={"flags": ("--json",)})

    def __post_init__(self):
        check_choices(self)
        check_sizes(self, "tokens")
        check_counts(self, "ep", "rounds")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"EpExchangeConfig.capacity_factor must be > 0, got "
                             f"{self.capacity_factor!r}")


def run(config: EpExchangeConfig, log=print) -> tuple[str, list[dict]]:
    """(the experts' path used, one point per token count), each point logged as its table line
    when done."""
    from jaxpipe.kernels import matmul

    path = config.path or ("grouped" if matmul.available() else "dense")
    points = []
    for t in config.tokens:
        cap = capacity_for(t, config.ep, SHAPE["k"], config.capacity_factor)
        points.append(measure(t, config.ep, config.rounds, path, cap))
        log(format_table(points[-1:]).splitlines()[1])
    return path, points


def ep_mesh(ep: int) -> Mesh:
    """A 1-D mesh of the first `ep` devices, axis "ep"."""
    devices = jax.devices()
    if ep < 1 or ep > len(devices):
        raise ValueError(f"ep={ep} needs 1..{len(devices)} devices (JAX sees {len(devices)}; "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8 gives 8 on CPU)")
    return Mesh(np.array(devices[:ep]), ("ep",))


def psum_layer(mesh: Mesh, k: int, path: str = "dense"):
    """jit(h [T, E], router [E, X], w_gate_up [X, E, 2, F], w_down [X, F, E]) -> [T, E] f32,
    the engine's way: h replicated, experts split over ep, one psum of the partial outputs."""

    def body(h, router, gate_up, down):  # h [T, E]; gate_up [X/ep, E, 2, F]
        weights, chosen = moe.route(h, router, k, True)  # [T, k]
        weights, chosen = decoder.local_experts(weights, chosen, lax.axis_index("ep"),
                                                gate_up.shape[0])
        out = moe.experts_mlp(h, weights, chosen, gate_up, down, path)  # [T, E] partial
        return lax.psum(out, "ep")

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("ep"), P("ep")),
                                 out_specs=P(), check_vma=False))


def a2a_layer(mesh: Mesh, k: int, path: str = "dense", capacity: int | None = None):
    """jit(h [T, E], router, w_gate_up, w_down) -> ([T, E] f32, dropped pairs i32), the
    all-to-all way: h split over ep by rows, each pair's row sent to its expert's device and
    back (`capacity`: see the module docstring)."""
    ep = mesh.shape["ep"]

    def body(h, router, gate_up, down):  # h [T/ep, E]; gate_up [X/ep, E, 2, F]
        local = gate_up.shape[0]
        cap = capacity or h.shape[0] * k
        weights, chosen = moe.route(h, router, k, True)  # [T/ep, k], global expert ids
        dest, slot = _slots(chosen.reshape(-1) // local, ep)  # [T/ep*k] each
        rows = jnp.repeat(h, k, axis=0)  # [T/ep*k, E]: pair i is row i // k's slot i % k
        send = jnp.zeros((ep, cap, h.shape[1]), h.dtype).at[dest, slot].set(rows, mode="drop")
        ids = jnp.full((ep, cap), local, jnp.int32).at[dest, slot].set(
            chosen.reshape(-1) % local, mode="drop")  # [ep, C]; empty: out of range, skipped
        recv = lax.all_to_all(send, "ep", 0, 0, tiled=True)  # [ep, C, E] from each source
        recv_ids = lax.all_to_all(ids, "ep", 0, 0, tiled=True)
        out = moe.experts_mlp(recv.reshape(ep * cap, -1), jnp.ones((ep * cap, 1)),
                              recv_ids.reshape(-1, 1), gate_up, down, path)
        back = lax.all_to_all(out.reshape(ep, cap, -1), "ep", 0, 0, tiled=True)
        products = back.at[dest, slot].get(mode="fill", fill_value=0.0)  # [T/ep*k, E]
        combined = jnp.einsum("tk,tkd->td", weights, products.reshape(h.shape[0], k, -1))
        return combined, lax.psum(jnp.sum(slot >= cap), "ep")

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P(), P("ep"), P("ep")),
                                 out_specs=(P("ep"), P()), check_vma=False))


def _slots(dest, ep: int):
    """dest [N] (each pair's destination device) -> (dest, each pair's place among the pairs
    to its destination, in order)."""
    onehot = jax.nn.one_hot(dest, ep, dtype=jnp.int32)  # [N, ep]
    slot = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    return dest, slot


def layer_inputs(tokens: int, experts: int, hidden: int, width: int, seed: int = 0,
                 dtype=jnp.bfloat16):
    """h [T, E] f32, router [E, X] f32, w_gate_up [X, E, 2, F] and w_down [X, F, E] in
    `dtype`, seeded normal (expert weights scaled by 1/sqrt of their fan-in)."""
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(tokens, hidden))
    router = rng.normal(size=(hidden, experts))
    gate_up = rng.normal(size=(experts, hidden, 2, width)) / hidden ** 0.5
    down = rng.normal(size=(experts, width, hidden)) / width ** 0.5
    return (jnp.asarray(h, jnp.float32), jnp.asarray(router, jnp.float32),
            jnp.asarray(gate_up, dtype), jnp.asarray(down, dtype))


def exchange_bytes(tokens: int, hidden: int, k: int, ep: int, capacity: int | None) -> dict:
    """Bytes each device sends per layer (f32 rows): a ring all-reduce of [T, E] sends
    2(ep-1)/ep of it; the two all-to-alls send (ep-1)/ep of their [ep, C, E] buffers."""
    row = 4 * hidden
    cap = capacity or tokens // ep * k
    return {"psum": 2 * (ep - 1) / ep * tokens * row,
            "a2a": 2 * (ep - 1) / ep * ep * cap * row}


def _time(fn, args, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times


def measure(tokens: int, ep: int, rounds: int, path: str, capacity: int | None = None,
            shape: dict | None = None) -> dict:
    """One point: both ways' median ms over `rounds` interleaved rounds (after a warm-up
    call each), and the largest difference between their outputs, asserted within 2% of the
    output's largest value unless pairs were dropped: the bf16 weights' rounding (the dense
    path rounds the gated activations to bf16 with the router weight inside in "psum",
    with 1 in "a2a", whose weights multiply afterwards)."""
    s = shape or SHAPE
    if tokens % ep or s["experts"] % ep:
        raise ValueError(f"ep={ep} must divide the tokens ({tokens}) and the experts "
                         f"({s['experts']})")
    mesh = ep_mesh(ep)
    args = layer_inputs(tokens, s["experts"], s["hidden"], s["width"])
    fns = {"psum": psum_layer(mesh, s["k"], path),
           "a2a": a2a_layer(mesh, s["k"], path, capacity)}
    want, (got, dropped) = fns["psum"](*args), fns["a2a"](*args)
    diff = float(jnp.max(jnp.abs(want - got)))
    scale = float(jnp.max(jnp.abs(want)))
    if int(dropped) == 0 and not diff <= 2e-2 * scale:
        raise AssertionError(f"T={tokens}: psum and a2a outputs differ by {diff} "
                             f"(scale {scale})")
    times = {w: [] for w in WAYS}
    for _ in range(rounds):
        for w in WAYS:
            times[w] += _time(fns[w], args, 1)
    ms = {w: statistics.median(t) * 1e3 for w, t in times.items()}
    return {"tokens": tokens, "ep": ep, **s, "path": path, "rounds": rounds,
            "capacity": capacity or tokens // ep * s["k"], "dropped": int(dropped),
            "max_abs_diff": diff, "ms": ms, "a2a_over_psum": ms["a2a"] / ms["psum"],
            "bytes_sent_per_device": exchange_bytes(tokens, s["hidden"], s["k"], ep,
                                                    capacity)}


def format_table(points: list[dict]) -> str:
    """A fixed-width table, one line per point: C the all-to-all's rows per (source,
    destination) buffer, MB what each device sends per layer, dropped the pairs past C."""
    head = (f"{'X k E F':>16} {'ep':>3} {'T':>5} {'C':>5} {'psum ms':>9} {'a2a ms':>9} "
            f"{'a2a/psum':>9} {'psum MB':>8} {'a2a MB':>8} {'dropped':>7} {'max|diff|':>10}")
    lines = [head]
    for p in points:
        mb = {w: p["bytes_sent_per_device"][w] / 1e6 for w in WAYS}
        case = f"{p['experts']} {p['k']} {p['hidden']} {p['width']}"
        lines.append(f"{case:>16} {p['ep']:>3} {p['tokens']:>5} {p['capacity']:>5} "
                     f"{p['ms']['psum']:>9.2f} {p['ms']['a2a']:>9.2f} "
                     f"{p['a2a_over_psum']:>9.2f} {mb['psum']:>8.3f} {mb['a2a']:>8.3f} "
                     f"{p['dropped']:>7} {p['max_abs_diff']:>10.2e}")
    return "\n".join(lines)


def capacity_for(tokens: int, ep: int, k: int, factor: float | None) -> int | None:
    """Rows per (source, destination) buffer at `factor` times the balanced share
    (T/ep * k / ep), at least 1; None (no factor): the no-drop worst case."""
    if factor is None:
        return None
    return max(1, math.ceil(factor * tokens / ep * k / ep))

