"""Multi-step pipelined decode (`pipeline.multistep_decode_program` via `LayoutRunner.decode`
with steps > 1) on the prime-sized tiny model: K steps in one program give the tokens of K
one-step calls (today's program + sampler) and of the single-device model, write the same KV,
keep every stage busy, and leave idle rows and rows past the cache's end harmless."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY

from jaxpipe import pipeline, sampling
from jaxpipe.buckets import Buckets
from jaxpipe.kv import device_cache
from jaxpipe.layout import Layout
from jaxpipe.layout_runner import DEFAULT_DECODE_STEPS, LayoutRunner
from jaxpipe.model.llama import Llama
from jaxpipe.runner import Runner, SamplingPlan
from jaxpipe.sampling import SamplingParams

SLOTS, MAX_LEN, PROMPT = 8, 64, 16
LENGTHS = np.array([16, 9, 3, 12, 1, 16, 7, 10], np.int32)
ACTIVE = np.array([1, 1, 0, 1, 1, 1, 0, 1], bool)  # rows 2 and 6 idle
# (decode layout, steps per call): the hybrid and deep pipelines of the issue.
CASES = [("pp=2,tp=4", 3), ("pp=4,tp=2", 4), ("pp=8", 3)]
# The runners' KV is paged: each slot's 4 blocks scattered over a pool of 35.
POOL = 35
TABLE = np.random.default_rng(2).permutation(POOL)[:SLOTS * 4].reshape(SLOTS, 4).astype(np.int32)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, TINY.vocab_size, (SLOTS, PROMPT)).astype(np.int32)
    return [list(t[:n]) for t, n in zip(tokens, LENGTHS, strict=True)]


@pytest.fixture(scope="module")
def reference(tiny_values, prompts):
    """Single device (contiguous blocks), greedy: tokens [N, 1 + K] (the prefill's, then K
    decode steps) and the per-layer K [N, Hkv, S, D] after them, for the largest K of CASES."""
    steps = max(k for _, k in CASES)
    model = Llama(TINY, values=tiny_values)
    table = device_cache.identity_table(SLOTS, MAX_LEN)
    cache = device_cache.allocate(TINY, table.size, jnp.float32)
    padded = np.array([p + [0] * (PROMPT - len(p)) for p in prompts], np.int32)
    logits, cache = model.prefill(jnp.asarray(padded), LENGTHS, table, cache)
    tokens = [np.asarray(jnp.argmax(logits, -1), np.int32)]
    for k in range(steps):
        logits, cache = model.decode(jnp.asarray(tokens[-1]), LENGTHS + k, table, cache,
                                     MAX_LEN)
        tokens.append(np.asarray(jnp.argmax(logits, -1), np.int32))
    return np.stack(tokens, 1), [dense(c.k, table) for c in cache]


def dense(pool, table) -> np.ndarray:
    """One layer's block pool [NB, Hkv, 16, D] seen per table row: [N, Hkv, MAX_LEN, D]."""
    return np.asarray(device_cache.gather(jnp.asarray(pool), jnp.asarray(table), MAX_LEN))


def plan_for(params: list[SamplingParams], step: int = 0, banned=None) -> SamplingPlan:
    seeds = [1000 + i for i in range(SLOTS)]
    t = sampling.build_sampling_tensors(params, seeds, [step] * SLOTS,
                                        banned or [[]] * SLOTS, SLOTS)
    logprobs = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingPlan(t, sampling.sampling_mode(params), sampling.uses_penalties(params),
                        max(logprobs) if logprobs else None)


GREEDY = [SamplingParams(temperature=0.0)] * SLOTS
PLAIN = [SamplingParams(temperature=0.9)] * SLOTS
# Every switch at once: top_k / top_p rows ("sorted"), penalties, greedy rows, logprobs.
MIXED = [SamplingParams(temperature=0.8, top_k=20, logprobs=3),
         SamplingParams(temperature=0.0, repetition_penalty=1.3),
         SamplingParams(temperature=1.1),
         SamplingParams(temperature=0.7, top_p=0.6, frequency_penalty=0.5, logprobs=5),
         SamplingParams(temperature=1.0, min_p=0.05, presence_penalty=1.0),
         SamplingParams(temperature=0.0, logprobs=0),
         SamplingParams(temperature=0.9, top_k=5, top_p=0.9),
         SamplingParams(temperature=1.3, repetition_penalty=0.8)]


@pytest.fixture(scope="module")
def runners(tiny_values):
    """layout -> a runner with that prefill and decode layout (compiled programs are kept
    across tests; every test restarts from its own prefill)."""
    made = {}

    def get(layout: str, steps: int) -> LayoutRunner:
        if layout not in made:
            layouts = {"prefill": Layout.parse(layout), "decode": Layout.parse(layout)}
            made[layout] = LayoutRunner(
                TINY, tiny_values, Buckets.for_engine(SLOTS, MAX_LEN, 256), SLOTS, MAX_LEN,
                jnp.float32, layouts, jax.devices()[:8], decode_steps_per_call=steps,
                num_blocks=POOL)
            for slot, blocks in enumerate(TABLE):
                made[layout].set_blocks(slot, list(blocks))
        assert made[layout].decode_steps == steps
        return made[layout]

    return get


def prefilled(runners, layout: str, prompts, params, steps: int) -> tuple[LayoutRunner, dict]:
    """The runner of `layout` after prefilling `prompts` into slots 0..N-1 with `params`,
    and a snapshot of its state to restart from."""
    r = runners(layout, steps)
    first = r.prefill(prompts, list(range(SLOTS)), plan_for(params), (SLOTS, PROMPT)).tokens
    r.set_phase("decode")  # the same layout: nothing moves
    return r, {"first": first.astype(np.int32), **snapshot(r)}


def snapshot(r: LayoutRunner) -> dict:
    return {"cache": jax.tree.map(jnp.copy, r.cache), "out_counts": jnp.copy(r.out_counts)}


def restore(r: LayoutRunner, state: dict) -> None:
    r.cache = jax.tree.map(jnp.copy, state["cache"])
    r.out_counts = jnp.copy(state["out_counts"])


def one_step_calls(r: LayoutRunner, state: dict, params, steps: int, positions=None,
                   active=ACTIVE):
    """`steps` one-step calls of today's path (one-step program, then the separate sampler)
    from `state`. Returns (tokens [N, steps], logprob [N, steps] | None, top ids
    [N, steps, num] | None, state after)."""
    restore(r, state)
    positions = LENGTHS if positions is None else positions
    tokens, outs = state["first"], []
    for k in range(steps):
        pos = (positions + k).astype(np.int32)
        lengths = np.where(active, np.minimum(pos + 1, MAX_LEN), 0).astype(np.int32)
        logits = r.decode_logits(tokens, pos, lengths, MAX_LEN, TABLE)
        out = r._sample_host(logits, np.arange(SLOTS, dtype=np.int32), plan_for(params, k),
                             SLOTS)
        outs.append(out)
        tokens = out.tokens.astype(np.int32)
    stack = [None if outs[0].logprob is None else np.stack([getattr(o, f) for o in outs], 1)
             for f in ("logprob", "top_ids")]
    return np.stack([o.tokens for o in outs], 1), *stack, snapshot(r)


def multi_step(r: LayoutRunner, state: dict, params, steps: int, positions=None):
    restore(r, state)
    positions = LENGTHS if positions is None else positions
    return r.decode(state["first"], positions, ACTIVE, plan_for(params), steps=steps)


def layer_k(r: LayoutRunner, cache_k) -> list[np.ndarray]:
    """The padded stacked K pool [L', NB, Hkv', 16, D] -> per real layer and slot
    [N, Hkv, S, D]."""
    k = np.asarray(cache_k)
    layers, heads = r.plan.index["layers"], r.plan.index["kv_heads"]
    first_rep = [heads.index(h) for h in range(TINY.num_kv_heads)]
    return [dense(k[layers.index(i)][:, first_rep], TABLE) for i in range(TINY.num_layers)]


@pytest.mark.parametrize("layout, steps", CASES)
def test_greedy_steps_match_one_step_calls_and_one_device(runners, prompts, reference, layout,
                                                          steps):
    r, state = prefilled(runners, layout, prompts, GREEDY, steps)
    ref_tokens, ref_k = reference
    assert np.array_equal(state["first"], ref_tokens[:, 0])
    out = multi_step(r, state, GREEDY, steps)
    after = snapshot(r)
    assert out.tokens.shape == (SLOTS, steps) and out.logprob is None
    assert np.array_equal(out.tokens[ACTIVE], ref_tokens[ACTIVE, 1:steps + 1])
    legacy, _, _, legacy_state = one_step_calls(r, state, GREEDY, steps)
    assert np.array_equal(out.tokens[ACTIVE], legacy[ACTIVE])

    # Active rows' KV equals the single-device model's up to the last position written and
    # the one-step calls' everywhere; idle rows' KV is untouched.
    got, before = layer_k(r, after["cache"].k), layer_k(r, state["cache"].k)
    legacy_k = layer_k(r, legacy_state["cache"].k)
    end = LENGTHS + steps
    for i in range(TINY.num_layers):
        for row in range(SLOTS):
            if ACTIVE[row]:
                want = ref_k[i][row, :, :end[row]]
                assert np.abs(got[i][row, :, :end[row]] - want).max() <= 1e-4, (i, row)
                assert np.array_equal(got[i][row], legacy_k[i][row])
            else:
                assert np.array_equal(got[i][row], before[i][row])


@pytest.mark.parametrize("layout, steps", CASES)
def test_every_stage_is_busy(runners, prompts, layout, steps):
    r, state = prefilled(runners, layout, prompts, GREEDY, steps)
    multi_step(r, state, GREEDY, steps)
    pp = r.layout.pp
    m = pipeline.microbatches(SLOTS, pp)
    assert m == pp
    assert r.decode_ticks == steps * m + pp - 1 < steps * (m + pp - 1)
    # Each stage works on a real micro-batch in all but pp - 1 ticks (fill / drain).
    assert np.asarray(r.decode_busy).tolist() == [steps * m] * pp
    # The same program with steps = 1 is one GPipe pass: M of M + pp - 1 ticks.
    one = r.decode(state["first"], LENGTHS, ACTIVE, plan_for(GREEDY), steps=1)
    assert one.tokens.shape == (SLOTS,)
    assert r.decode_ticks == m + pp - 1
    assert np.asarray(r.decode_busy).tolist() == [m] * pp


@pytest.mark.parametrize("layout, steps", CASES)
@pytest.mark.parametrize("params", [PLAIN, MIXED], ids=["plain", "mixed"])
def test_sampled_steps_match_one_step_calls(runners, prompts, layout, steps, params):
    r, state = prefilled(runners, layout, prompts, params, steps)
    out = multi_step(r, state, params, steps)
    counts = np.asarray(r.out_counts) - np.asarray(state["out_counts"])
    tokens, logprob, top_ids, legacy_state = one_step_calls(r, state, params, steps)
    assert np.array_equal(out.tokens[ACTIVE], tokens[ACTIVE])
    if params is MIXED:  # penalties and logprobs
        num = 5
        assert out.logprob.shape == (SLOTS, steps)
        assert out.top_ids.shape == out.top_logprobs.shape == (SLOTS, steps, num)
        assert np.allclose(out.logprob[ACTIVE], logprob[ACTIVE], atol=1e-5)
        assert np.array_equal(out.top_ids[ACTIVE], top_ids[ACTIVE])
        want = np.asarray(legacy_state["out_counts"]) - np.asarray(state["out_counts"])
        assert np.array_equal(counts[ACTIVE], want[ACTIVE])
        assert counts[ACTIVE].sum() == steps * ACTIVE.sum()
    # Fewer steps than the program's cap: the first tokens of the same draws.
    shorter = multi_step(r, state, params, steps - 1)
    assert np.array_equal(shorter.tokens[ACTIVE], tokens[ACTIVE, :steps - 1])


def test_row_reaching_the_cache_end_leaves_other_rows_alone(runners, prompts):
    """Row 3 starts two positions before the end of its slot: its writes past the end are
    dropped, and every other row decodes and writes exactly as without it."""
    layout, steps = "pp=4,tp=2", 4
    r, state = prefilled(runners, layout, prompts, GREEDY, steps)
    positions = LENGTHS.copy()
    positions[3] = MAX_LEN - 2
    out = multi_step(r, state, GREEDY, steps, positions)
    got = layer_k(r, r.cache.k)
    legacy, _, _, legacy_state = one_step_calls(r, state, GREEDY, steps, positions)
    want = layer_k(r, legacy_state["cache"].k)
    others = ACTIVE.copy()
    others[3] = False
    assert np.array_equal(out.tokens[others], legacy[others])
    assert np.array_equal(out.tokens[3, :2], legacy[3, :2])  # positions 62, 63 are in range
    for i in range(TINY.num_layers):
        assert np.array_equal(got[i][ACTIVE], want[i][ACTIVE]), i
    assert got[0][3, :, MAX_LEN - 2:].any()  # the two in-range writes happened


def test_fewer_micro_batches_than_stages(runners, prompts):
    """4 rows on 8 stages: M = 4 < pp leaves a gap in each step's round (ticks
    (K - 1) * pp + M + pp - 1), and the tokens still equal one-step calls."""
    layout, steps, rows = "pp=8", 3, 4
    r, state = prefilled(runners, layout, prompts, PLAIN, steps)
    params = PLAIN[:rows]
    t = sampling.build_sampling_tensors(params, list(range(rows)), [0] * rows, [[]] * rows,
                                        rows)
    plan = SamplingPlan(t, "plain", False, None)
    tokens, positions = state["first"][:rows], LENGTHS[:rows]
    out = r.decode(tokens, positions, np.ones(rows, bool), plan, steps=steps)
    assert r.decode_ticks == (steps - 1) * 8 + rows + 8 - 1
    assert np.asarray(r.decode_busy).tolist() == [steps * rows] * 8
    restore(r, state)
    for k in range(steps):
        plan = SamplingPlan(t._replace(step=t.step + k), "plain", False, None)
        one = r.decode(tokens, positions + k, np.ones(rows, bool), plan, steps=1)
        assert np.array_equal(one.tokens, out.tokens[:, k]), k
        tokens = one.tokens.astype(np.int32)


def test_decode_steps_per_call(tiny_values):
    def runner(decode: str, **kw) -> LayoutRunner:
        layouts = {"prefill": Layout.parse("pp=8"), "decode": Layout.parse(decode)}
        return LayoutRunner(TINY, tiny_values, Buckets.for_engine(SLOTS, MAX_LEN, 256), SLOTS,
                            MAX_LEN, jnp.float32, layouts, jax.devices()[:8], **kw)

    assert runner("tp=8").decode_steps == 1
    assert runner("pp=2,tp=4").decode_steps == DEFAULT_DECODE_STEPS
    assert runner("pp=2,tp=4", decode_steps_per_call=7).decode_steps == 7
    with pytest.raises(ValueError, match="decode_steps_per_call"):
        runner("pp=8", decode_steps_per_call=0)


def test_single_device_runner_decodes_one_step(tiny_values):
    model = Llama(TINY, values=tiny_values)
    r = Runner(model, Buckets.for_engine(SLOTS, MAX_LEN, 256), SLOTS, MAX_LEN, jnp.float32)
    assert r.decode_steps == 1
    with pytest.raises(ValueError, match="steps=2"):
        r.decode(np.zeros(SLOTS, np.int32), LENGTHS, ACTIVE, plan_for(GREEDY), steps=2)


def test_ticks_formula():
    # K steps of M = pp micro-batches: K*M + pp - 1 ticks (GPipe per step: K*(M + pp - 1)).
    assert pipeline.interleaved_ticks(4, 2, 2) == 9
    assert pipeline.interleaved_ticks(4, 8, 8) == 39
    assert pipeline.interleaved_ticks(1, 4, 4) == 7
