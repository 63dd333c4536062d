"""The C++ grouped (sorted-segment) bf16 matmul against a float64 NumPy reference of the
bf16-rounded inputs, on each of its paths this machine's build has (the others are skipped,
saying so): groups of 0 rows (an expert no token chooses) at either end and between, all rows
in one group, uneven groups, rows past the groups; the fused gate. Then `model/moe.py`'s
"grouped" path against its "dense" one and a float64 reference of the experts."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.kernels import matmul as mm
from jaxpipe.model import moe
from jaxpipe.runtime import kernel_choice

pytestmark = pytest.mark.skipif(not mm.available(), reason="kernel cannot be built here")


def numpy_grouped(x, w, sizes, gated: bool) -> np.ndarray:
    """float64: bf16(x)'s consecutive groups of rows times their group's weight; rows past
    the groups zero; `gated`: silu(first half of the columns) * second half."""
    xb = np.asarray(jnp.asarray(x).astype(jnp.bfloat16), np.float64)
    wf = np.asarray(w, np.float64)
    y = np.zeros((xb.shape[0], wf.shape[2]))
    m0 = 0
    for g, rows in enumerate(sizes):
        y[m0:m0 + rows] = xb[m0:m0 + rows] @ wf[g]
        m0 += rows
    if gated:
        half = y.shape[1] // 2
        y = y[:, :half] / (1 + np.exp(-y[:, :half])) * y[:, half:]
    return y


def inputs(m, g, k, n, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)  # not bf16-exact: the kernel rounds
    w = jnp.asarray(rng.normal(size=(g, k, n)) / k ** 0.5, jnp.bfloat16)
    return x, w


# (sizes, rows M): zero-row groups first, between and last; everything in one group; uneven
# groups over more than one row chunk (48); rows past the last group.
SIZES = [([0, 5, 0, 17, 1, 0], 23), ([0, 0, 31, 0], 31), ([50, 3, 7, 1], 61),
         ([2, 0, 4], 9), ([0, 0, 0], 4)]


@pytest.mark.parametrize("sizes, m", SIZES)
@pytest.mark.parametrize("gated", [False, True])
def test_matches_float64(sizes, m, gated, path):
    k, n = 70, 2 * 75  # neither a multiple of the 64-column panel
    x, w = inputs(m, len(sizes), k, n)
    got = np.asarray(mm.grouped_matmul(x, w, np.asarray(sizes, np.int32), gated=gated,
                                       path=path))
    want = numpy_grouped(x, w, sizes, gated)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_stack_of_layers_reads_the_traced_layer(path):
    x, w = inputs(20, 3, 64, 192, seed=1)
    stack = jnp.stack([w, -w])  # [L=2, G, K, N]
    sizes = jnp.asarray([6, 0, 14], jnp.int32)
    fn = jax.jit(lambda x, s, layer: mm.grouped_matmul(x, stack, s, layer, path=path))
    np.testing.assert_allclose(np.asarray(fn(x, sizes, jnp.int32(1))),
                               -numpy_grouped(x, w, [6, 0, 14], False), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sizes, what", [([3, -1, 2], "group 1 has -1 rows"),
                                         ([3, 4, 2], "group 2 has 2 rows after 7")])
def test_bad_group_sizes_fail_naming_them(sizes, what):
    x, w = inputs(8, 3, 16, 32)
    with pytest.raises(Exception, match=f"sum to at most M = 8; {what}"):
        jax.block_until_ready(mm.grouped_matmul(x, w, np.asarray(sizes, np.int32)))


def test_bad_shapes_fail_naming_them():
    x, w = inputs(8, 3, 16, 32)
    with pytest.raises(ValueError, match=r"sizes must be \[G\] = \[3\]; got \(2,\)"):
        mm.grouped_matmul(x, w, np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="K must be even"):
        mm.grouped_matmul(x[:, :15], w[:, :15], np.zeros(3, np.int32))
    with pytest.raises(ValueError, match=r"a layer index goes with a stacked w \[L, G, K, N\]"):
        mm.grouped_matmul(x, w, np.zeros(3, np.int32), 0)


# ---- model/moe.py's grouped path -------------------------------------------------------


def experts_reference(h, weights, experts, w_gate_up, w_down) -> np.ndarray:
    """float64 of the bf16 weights and bf16-rounded activations, as both paths round."""
    def bf16(a):
        return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16), np.float64)

    h, gu, dn = bf16(h), np.asarray(w_gate_up, np.float64), np.asarray(w_down, np.float64)
    out = np.zeros_like(h)
    for t, (ws, xs) in enumerate(zip(np.asarray(weights), np.asarray(experts), strict=True)):
        for w, x in zip(ws, xs, strict=True):
            g, u = h[t] @ gu[x, :, 0], h[t] @ gu[x, :, 1]
            out[t] += w * (bf16(g / (1 + np.exp(-g)) * u) @ dn[x])
    return out


@pytest.mark.parametrize("x, k, tokens", [(8, 2, 1), (8, 2, 13), (16, 4, 40)])
def test_grouped_path_equals_dense_and_float64(x, k, tokens):
    e, f = 48, 80
    rng = np.random.default_rng(x * tokens)
    h = jnp.asarray(rng.normal(size=(tokens, e)), jnp.float32)
    w_gate_up = jnp.asarray(rng.normal(size=(x, e, 2, f)) / e ** 0.5, jnp.bfloat16)
    w_down = jnp.asarray(rng.normal(size=(x, f, e)) / f ** 0.5, jnp.bfloat16)
    weights, experts = moe.route(h, jnp.asarray(rng.normal(size=(e, x)), jnp.float32), k, True)
    run = jax.jit(moe.experts_mlp, static_argnames="path")
    got = np.asarray(run(h, weights, experts, w_gate_up, w_down, path="grouped"))
    dense = np.asarray(run(h, weights, experts, w_gate_up, w_down, path="dense"))
    want = experts_reference(h, weights, experts, w_gate_up, w_down)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-2 * scale)
    np.testing.assert_allclose(got, dense, rtol=0, atol=1e-2 * scale)


@pytest.mark.parametrize("name", ["grouped", "dense", "ragged"])
def test_expert_shards_sum_to_the_whole(name):
    """Under expert parallelism each of 2 shards sees another shard's choices as the
    out-of-range id (`decoder.local_experts`), which every path skips: the shards'
    outputs sum to the float64 whole, and a shard whose experts no token chose gives 0."""
    from jaxpipe.model.decoder import local_experts

    x, k, e, f, tokens = 8, 2, 48, 80, 11
    rng = np.random.default_rng(5)
    h = jnp.asarray(rng.normal(size=(tokens, e)), jnp.float32)
    w_gate_up = jnp.asarray(rng.normal(size=(x, e, 2, f)) / e ** 0.5, jnp.bfloat16)
    w_down = jnp.asarray(rng.normal(size=(x, f, e)) / f ** 0.5, jnp.bfloat16)
    weights, experts = moe.route(h, jnp.asarray(rng.normal(size=(e, x)), jnp.float32), k, True)
    run = jax.jit(moe.experts_mlp, static_argnames="path")
    parts = []
    for index in range(2):
        w, ids = local_experts(weights, experts, index, x // 2)
        assert ((ids == x // 2) == (experts // (x // 2) != index)).all()
        parts.append(np.asarray(run(h, w, ids, w_gate_up[index * 4:index * 4 + 4],
                                    w_down[index * 4:index * 4 + 4], path=name)))
    want = experts_reference(h, weights, experts, w_gate_up, w_down)
    np.testing.assert_allclose(parts[0] + parts[1], want, rtol=0,
                               atol=1e-2 * np.abs(want).max())
    none = jnp.full_like(experts, x // 2)  # every choice another shard's
    assert not np.asarray(run(h, weights, none, w_gate_up[:4], w_down[:4], path=name)).any()


def stacked_experts(layers: int, x: int, e: int, f: int, tokens: int, k: int):
    """h, weights, experts and `layers` layers of random experts' weights [L, X, ...]."""
    rng = np.random.default_rng(layers * tokens)
    h = jnp.asarray(rng.normal(size=(tokens, e)), jnp.float32)
    gate_up = jnp.asarray(rng.normal(size=(layers, x, e, 2, f)) / e ** 0.5, jnp.bfloat16)
    down = jnp.asarray(rng.normal(size=(layers, x, f, e)) / f ** 0.5, jnp.bfloat16)
    weights, experts = moe.route(h, jnp.asarray(rng.normal(size=(e, x)), jnp.float32), k, True)
    return h, weights, experts, gate_up, down


def on_layer(h, weights, experts, gate_up, down, layer, path):
    return moe.experts_mlp(h, weights, experts, mm.StackedWeight(gate_up, layer),
                           mm.StackedWeight(down, layer), path)


@pytest.mark.parametrize("name", moe.EXPERTS_PATHS)
def test_a_layer_of_the_stacked_experts_equals_its_slice(name):
    """The step hands the experts as layer j of the stack (`matmul.StackedWeight`): every
    path gives what it gives on the slice itself (grouped reads the stack in place)."""
    h, weights, experts, gate_up, down = stacked_experts(3, 8, 48, 80, 13, 2)
    run = jax.jit(on_layer, static_argnames="path")
    for layer in range(3):
        got = run(h, weights, experts, gate_up, down, jnp.int32(layer), path=name)
        want = moe.experts_mlp(h, weights, experts, gate_up[layer], down[layer], name)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_grouped_dispatch_copies_no_layer_of_the_stacked_experts():
    """A slice of the stack before the custom call is a copy of every expert's weights per
    layer and step (the step ran 3-6x slower with it): on `StackedWeight`s the compiled
    program holds no value of one layer's experts' shape; on the slices (as the step
    passed them before) it does."""
    x, e, f = 8, 48, 80
    h, weights, experts, gate_up, down = stacked_experts(3, x, e, f, 5, 2)
    one_layer = re.compile(rf"= bf16\[(1,)?{x},({e},2,{f}|{e},{2 * f}|{f},{e})\]")

    def copies(fn):  # the compiled program's values shaped as one layer's experts
        hlo = jax.jit(fn).lower(gate_up, down, jnp.int32(1)).compile().as_text()
        return [line for line in hlo.splitlines() if one_layer.search(line)]

    assert copies(lambda gu, dn, j: on_layer(h, weights, experts, gu, dn, j, "grouped")) == []
    assert copies(lambda gu, dn, j: moe.experts_mlp(h, weights, experts, gu[j], dn[j],
                                                    "grouped")) != []


def test_grouped_dispatch_refuses_what_the_kernel_cannot_run():
    h = jnp.zeros((3, 10), jnp.float32)
    weights, experts = jnp.ones((3, 1)), jnp.zeros((3, 1), jnp.int32)
    w_gate_up, w_down = jnp.zeros((2, 10, 2, 7), jnp.bfloat16), jnp.zeros((2, 7, 10), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"'grouped' needs .* even E and F; got w_gate_up "
                                         r"\(2, 10, 2, 7\) bfloat16"):
        moe.experts_mlp(h, weights, experts, w_gate_up, w_down, "grouped")
    # F odd, or f32 weights: dense, no measurement either
    assert kernel_choice.experts_path(3, 1, w_gate_up, w_down) == "dense"
    assert kernel_choice.experts_path(3, 1, w_gate_up.astype(jnp.float32)[..., :6],
                                     w_down.astype(jnp.float32)[:, :6]) == "dense"


@pytest.mark.parametrize("force, want", [("xla", "dense"), (mm.paths()[0], "grouped")])
def test_a_forced_matmul_decides_the_experts_dispatch(force, want, tmp_path):
    """EngineConfig.matmul reaches the experts: the engine's kernel choice, forced, picks the
    path with no measurement (an empty cache stays empty)."""
    w_gate_up, w_down = jnp.zeros((4, 8, 2, 6), jnp.bfloat16), jnp.zeros((4, 6, 8), jnp.bfloat16)
    chosen = kernel_choice.KernelChoice(force, cache=tmp_path / "timings.json")
    assert kernel_choice.experts_path(16, 2, w_gate_up, w_down, chosen) == want
    assert not chosen.timings


def test_engine_step_on_the_grouped_dispatch_gives_the_dense_dispatchs_tokens(tmp_path,
                                                                                monkeypatch):
    """A bf16 Qwen3-MoE (even expert widths, which the kernel needs) through the engine's
    step (the layer scan inside `shard_map`, chunked prefill, decode): greedy tokens of the
    grouped path equal the dense one's (which tests/model/test_moe_hf.py checks against
    HF)."""
    transformers = pytest.importorskip("transformers")
    from hf_families import PROMPTS, draw_every_parameter
    from hf_moe import EAGER, SMALL

    from jaxpipe import Engine, EngineConfig, SamplingParams

    config = transformers.Qwen3MoeConfig(**SMALL, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=24, intermediate_size=50,
                                         norm_topk_prob=True, **EAGER)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    draw_every_parameter(model, seed=3)
    model.save_pretrained(tmp_path, safe_serialization=True)
    tokens = {}
    for name in ("dense", "grouped"):
        monkeypatch.setitem(moe.EXPERTS_PATH, "cpu", name)
        jax.clear_caches()  # no step traced on the other path is reused
        engine = Engine(EngineConfig(model=str(tmp_path), dtype="bfloat16", max_model_len=160,
                                     max_num_seqs=4, max_num_batched_tokens=32, warmup=False,
                                     show_progress=False))
        outs = engine.generate(prompt_token_ids=PROMPTS,
                               sampling_params=SamplingParams(temperature=0.0, max_tokens=12))
        tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
        engine.close()
    jax.clear_caches()
    assert len({t for row in tokens["dense"] for t in row}) > 4  # not one repeated token
    assert tokens["grouped"] == tokens["dense"]
