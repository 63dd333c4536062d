"""The ragged step on every layout against the single-device whole-sequence forward pass, on a
tiny model with prime-sized dimensions (so every layout pads: identity layers, replicated KV
heads, zero query heads, mlp and vocab columns). Prompts are prefilled in ragged chunks, then
decoded greedily; every sampled row's logits must equal the reference's. Micro-batches flow
through the stages several at once (`runtime/flow.py`): each one's logits are still the
reference's, and the pipeline fills once and drains once."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY
from jax.sharding import PartitionSpec as P

from jaxpipe.config.layout import Layout
from jaxpipe.kernels import int8_matmul, matmul
from jaxpipe.model import decoder
from jaxpipe.model.decoder import Decoder
from jaxpipe.model.quantized import Quantization
from jaxpipe.runtime import sharding, step_inputs
from jaxpipe.runtime.buckets import Buckets
from jaxpipe.runtime.kernel_choice import KernelChoice
from jaxpipe.runtime.runner import Runner
from jaxpipe.runtime.step_inputs import Piece

LENGTHS = [16, 9, 3, 12, 1, 17, 7, 10]
POOL, MAX_LEN = 37, 64
# Each sequence's 4 blocks of 16, scattered over the pool.
TABLE = np.random.default_rng(4).permutation(POOL)[:32].reshape(8, 4).astype(np.int32)
LAYOUTS = ["pp=8", "pp=4,tp=2", "pp=2,tp=4", "tp=8", "tp=4,pp=2", "pp=1,tp=1"]
DECODE_STEPS = 3


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, TINY.vocab_size, n).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def forward(tiny_values):
    """Last-position logits of a whole sequence, on one device with the unpadded model."""
    model = Decoder(TINY, values=tiny_values)
    return lambda ids: np.asarray(model.forward(jnp.asarray([ids])))[0, -1]


def make_runner(values, layout: str, attention: str) -> Runner:
    parsed = Layout.parse(layout)
    devices = jax.devices()[: parsed.num_devices]
    return Runner(TINY, values, Buckets.for_engine(8, MAX_LEN, 64), 8, MAX_LEN, jnp.float32,
                  {"prefill": parsed, "decode": parsed}, devices, POOL, attention=attention)


def run(runner: Runner, pieces: list[Piece], sampled: int) -> np.ndarray:
    """Logits of the first `sampled` pieces' last tokens, every piece in one step."""
    return np.asarray(runner.logits(build(runner, pieces), sampled))


def build(runner: Runner, pieces: list[Piece]) -> step_inputs.StepInputs:
    tokens = runner.buckets.tokens(sum(len(p.tokens) for p in pieces))
    return step_inputs.build(pieces, tokens, runner.buckets.rows(tokens), runner.max_blocks)


# The Pallas kernel (interpreted: slow) on the layouts that split heads over tp in shard_map.
CASES = ([(layout, a) for a in ("xla", "auto") for layout in LAYOUTS]
         + [(layout, "pallas-interpret") for layout in ("tp=8", "pp=2,tp=4", "pp=1,tp=1")])


@pytest.mark.parametrize("layout,attention", CASES)
def test_ragged_steps_match_the_single_device_forward(tiny_values, prompts, forward, layout,
                                                      attention):
    runner = make_runner(tiny_values, layout, attention)
    half = [(n + 1) // 2 for n in LENGTHS]
    # Step 1: the first half of every prompt (ragged; the 1-token prompt ends here).
    first = [Piece(p[:h], 0, list(TABLE[i]))
             for i, (p, h) in enumerate(zip(prompts, half, strict=True))]
    order = sorted(range(8), key=lambda i: half[i] != LENGTHS[i])  # finished prompts first
    ended = sum(h == n for h, n in zip(half, LENGTHS, strict=True))
    logits = run(runner, [first[i] for i in order], ended)
    seqs = [list(p) for p in prompts]
    for row, i in enumerate(o for o in order if half[o] == LENGTHS[o]):
        np.testing.assert_allclose(logits[row], forward(seqs[i]), atol=2e-5, err_msg=f"seq {i}")
    # Step 2: the rest of each prompt, mixed with the decode token of the finished one.
    done = [i for i in range(8) if half[i] == LENGTHS[i]]
    for i in done:
        seqs[i].append(int(np.argmax(forward(seqs[i]))))
    pieces = [Piece([seqs[i][-1]], len(seqs[i]) - 1, list(TABLE[i])) for i in done]
    rest = [i for i in range(8) if i not in done]
    pieces += [Piece(prompts[i][half[i]:], half[i], list(TABLE[i])) for i in rest]
    logits = run(runner, pieces, 8)
    for row, i in enumerate(done + rest):
        np.testing.assert_allclose(logits[row], forward(seqs[i]), atol=2e-5, err_msg=f"seq {i}")
    # Decode steps: one token per sequence, greedy.
    for _ in range(DECODE_STEPS):
        for s in seqs:
            s.append(int(np.argmax(forward(s))))
        logits = run(runner, [Piece([s[-1]], len(s) - 1, list(TABLE[i]))
                              for i, s in enumerate(seqs)], 8)
        for i, s in enumerate(seqs):
            np.testing.assert_allclose(logits[i], forward(s), atol=2e-5, err_msg=f"seq {i}")


@pytest.mark.parametrize("layout", ["pp=8", "pp=4,tp=2", "pp=2,tp=4"])
def test_micro_batches_in_flight_together_each_match_the_forward(tiny_values, prompts,
                                                                 forward, layout):
    """Each prompt is one micro-batch, all dispatched before any is fetched: up to pp flow
    through the stages at once (their KV writes interleaved tick by tick), and each one's
    last-token logits are the single-device forward's. The pipeline filled once and drained
    once: pp - 1 idle stage-ticks at each end, none between."""
    runner = make_runner(tiny_values, layout, "auto")
    pp = Layout.parse(layout).pp
    handles = [runner.dispatch(build(runner, [Piece(p, 0, list(TABLE[i]))]),
                               np.zeros(0, np.int32), None) for i, p in enumerate(prompts)]
    hidden = [(h.result() if hasattr(h, "result") else h).done for h in handles]
    for i, h in enumerate(hidden):
        got = np.asarray(runner._head_logits(h, 1))[0]
        np.testing.assert_allclose(got, forward(prompts[i]), atol=2e-5, err_msg=f"seq {i}")
    counts = runner.ticks.counts()
    assert counts["ticks"] == len(prompts) + pp - 1
    assert counts["busy_slots"] == len(prompts) * pp
    assert counts["idle_slots"] == pp * (pp - 1)


@pytest.mark.parametrize("layout", ["pp=1,tp=1", "pp=2,tp=4"])
def test_bf16_step_with_the_cpu_kernels_matches_xla(tiny_values, prompts, layout):
    """bf16 weights: the C++ kernels (ragged attention, small-row matmuls) give the XLA path's
    logits within bf16 rounding, prefill and decode."""
    parsed = Layout.parse(layout)
    runners = [Runner(TINY, tiny_values, Buckets.for_engine(8, MAX_LEN, 128), 8, MAX_LEN,
                      jnp.bfloat16, {"prefill": parsed, "decode": parsed},
                      jax.devices()[: parsed.num_devices], POOL, attention=a)
               for a in ("auto", "xla")]
    if runners[0].attention != "cpu":
        pytest.skip("the C++ kernels cannot be built here")
    prefill = [Piece(p, 0, list(TABLE[i])) for i, p in enumerate(prompts)]
    decode = [Piece([5], len(p), list(TABLE[i])) for i, p in enumerate(prompts)]
    for pieces in (prefill, decode):
        got, want = (run(r, pieces, 8) for r in runners)
        np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)


# ---- static inter-stage transfers (SiPipe's structure-aware transmission) ---------------------


@pytest.mark.parametrize("layout", ["pp=2,tp=4", "pp=8", "pp=4,tp=2"])
@pytest.mark.parametrize("tokens", [16, 64])
def test_stages_exchange_only_fixed_shape_activations(tiny_values, layout, tokens):
    """Between stages a tick moves one [T, E] activation and nothing else: no per-step
    metadata (each stage's micro-batch's tables, spans and lengths enter as program inputs,
    one slot per stage), no host round trip (send / recv / infeed / outfeed / callbacks). Its
    shape depends only on the token bucket, so the receiver never waits for a description of
    what comes."""
    import re

    runner = make_runner(tiny_values, layout, "auto")
    pieces = [Piece([1, 2, 3], 0, [0]), Piece([4], 5, [1])]
    inputs = step_inputs.build(pieces, tokens, runner.buckets.rows(tokens), runner.max_blocks)
    tick = step_inputs.stack([inputs] * Layout.parse(layout).pp, tokens, inputs.num_rows)
    fn = runner._program(0 if runner.attention != "xla" else MAX_LEN)
    text = fn.lower(runner.params, runner.cache, runner.ticks.carried(runner.phase, tokens), tick,
                    runner._zeros()).as_text()
    moves = re.findall(r"stablehlo\.collective_permute.*:\s*\((tensor<[^>]*>)\)", text)
    assert moves == [f"tensor<{tokens}x{TINY.hidden_size}xf32>"]
    assert not re.search(r"\b(send|recv|infeed|outfeed)\b", text)
    calls = set(re.findall(r"custom_call @(\w+)", text))
    assert all(c.startswith("jaxpipe_") or c in ("Sharding", "SPMDFullToShardShape",
                                                 "SPMDShardToFullShape") for c in calls), calls



@pytest.mark.parametrize("layout", ["pp=8", "pp=4,tp=2", "pp=2,tp=4", "tp=8"])
def test_every_device_computes_its_own_slice_of_the_logits(tiny_values, prompts, forward,
                                                           layout):
    """The LM head's dot runs on each device over its own slice of the (padded) vocabulary,
    over pp too where the head's weights are whole on every stage (TINY's 251 tokens pad to
    256 columns: 8 slices), and the logits are the single-device forward's."""
    runner = make_runner(tiny_values, layout, "xla")
    place = runner.placements[runner.phase]
    hidden = runner.hidden(build(runner, [Piece(prompts[0], 0, list(TABLE[0]))]))
    logits = place.logits(runner.params, hidden, rows=1)
    np.testing.assert_allclose(np.asarray(logits)[0], forward(prompts[0]), atol=2e-5)
    padded = runner.padding.size("vocab", TINY.vocab_size)
    assert padded == 256
    hlo = place.logits.lower(runner.params, hidden, rows=1).compile().as_text()
    assert re.search(r"f32\[2,32\]\S* (dot|fusion)\(", hlo), hlo


# An even hidden size (panel order pairs K) and a vocabulary of 1021 tokens, padded to 1024:
# 128 columns, two panels, on each of 8 devices.
WIDE = dataclasses.replace(TINY, vocab_size=1021, hidden_size=38)


@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("layout", ["pp=8", "pp=4,tp=2"])
def test_the_kernels_lm_head_is_split_over_every_device_too(prompts, layout, quant):
    """A head the C++ kernel multiplies (panel order, bf16 or int8 codes) is whole on every
    stage, as XLA's is; each device multiplies only its own two panels of it, read in place
    (`pipeline.head_slices`), not the whole head, and the logits are those of the layout
    with the same tp and no pp."""
    if not (matmul.available() and (quant is None or int8_matmul.available())):
        pytest.skip("the C++ kernels cannot be built here")
    values = decoder.numpy_random_values(WIDE, seed=3)
    force = KernelChoice(force="portable")  # the same kernel path on every layout

    def runner(spec):
        parsed = Layout.parse(spec)
        return Runner(WIDE, values, Buckets.for_engine(8, MAX_LEN, 128), 8, MAX_LEN,
                      jnp.bfloat16, {"prefill": parsed, "decode": parsed},
                      jax.devices()[: parsed.num_devices], POOL, kernels=force,
                      quant=quant and Quantization(quant))

    # The reference has the same tp (int8 quantizes each tp shard's activations on its own)
    # and no pp: each device multiplies its whole tp shard of the head.
    one, split = runner("tp=2" if "tp=2" in layout else "pp=1,tp=1"), runner(layout)
    place = split.placements[split.phase]
    assert place.head_path is not None  # the kernel's head, not XLA's
    pieces = [Piece(p, 0, list(TABLE[i])) for i, p in enumerate(prompts)]
    np.testing.assert_allclose(run(split, pieces, 8), run(one, pieces, 8), atol=3e-2,
                               rtol=3e-2)
    hidden = split.hidden(build(split, pieces))
    hlo = place.logits.lower(split.params, hidden, rows=8).compile().as_text()
    assert re.findall(r"f32\[8,(\d+)\]\S* custom-call\(", hlo) == ["128"], hlo


def test_the_logits_split_over_the_axes_that_divide_the_vocabulary():
    assert sharding.logits_spec(Layout(pp=8), 49152) == P(None, ("pp",))
    assert sharding.logits_spec(Layout(pp=4, tp=2), 49152) == P(None, ("tp", "pp"))
    assert sharding.logits_spec(Layout(pp=4, tp=2), 252) == P(None, ("tp",))  # 8 does not divide
    assert sharding.logits_spec(Layout(pp=8), 251) == P(None, None)
    assert sharding.logits_spec(Layout(tp=8), 256) == P(None, ("tp",))
