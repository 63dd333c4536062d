"""Numerical parity with HF transformers on SmolLM2-135M-Instruct (both dequantize the same
Q4_1 GGUF to float32): greedy tokens through the engine, logits through the model-level API."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe import SamplingParams

torch = pytest.importorskip("torch")

EOS = 2  # <|im_end|>
NEW_TOKENS = 32
LOGITS_ATOL = 1e-3

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are a terse assistant. Answer in one word."},
     {"role": "user", "content": "What colour is the sky on a clear day?"}],
    [{"role": "user", "content": "Explain in detail how a bicycle works, covering the frame, "
                                 "the drivetrain, the brakes, the wheels and the steering."}],
    [{"role": "user", "content": "Translate to French: 'The cat sleeps on the mat.'"}],
    [{"role": "user", "content": "Name three prime numbers."},
     {"role": "assistant", "content": "2, 3 and 5."},
     {"role": "user", "content": "Three more, please."}],
    [{"role": "user", "content": "def fib(n):\n    # complete this Python function\n"}],
    [{"role": "user", "content": "List the planets of the solar system in order."}],
]

PLAIN_TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woodcutter and his three daughters. The youngest",
    "1, 2, 3,",
]


def _hf_chat_ids(hf_tokenizer, conversation) -> list[int]:
    ids = hf_tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    return [int(i) for i in ids]


def _hf_greedy(hf_model, prompt_ids: list[int]) -> tuple[list[int], np.ndarray]:
    """HF greedy continuation of one unpadded prompt: (new ids, log-softmax per step [n, V])."""
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=EOS,
                                output_logits=True, return_dict_in_generate=True)
    new = out.sequences[0, len(prompt_ids):].tolist()
    logits = torch.stack(out.logits)[:, 0].float()  # [n, V]
    return new, torch.log_softmax(logits, dim=-1).numpy()


def _hf_last_logits(hf_model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0, -1].float().numpy()


@pytest.fixture(scope="module")
def prompt_ids(hf_tokenizer) -> list[list[int]]:
    return [_hf_chat_ids(hf_tokenizer, c) for c in CONVERSATIONS]


@pytest.fixture(scope="module")
def hf_reference(hf_model, prompt_ids):
    """[(new token ids, log-probs [n, V])] per prompt, generated one prompt at a time."""
    return [_hf_greedy(hf_model, ids) for ids in prompt_ids]


@pytest.fixture(scope="module")
def batched(engine, hf_reference):
    """All conversations through `Engine.chat` as one mixed-length batch."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=5)
    return engine.chat(CONVERSATIONS, params)


def _assert_same_as_hf(out, ref_tokens: list[int], label: str) -> None:
    got = out.outputs[0]
    assert got.token_ids == ref_tokens, f"{label}: tokens differ from HF"
    if ref_tokens[-1] == EOS:
        assert got.finish_reason == "stop", label
    else:
        assert len(ref_tokens) == NEW_TOKENS
        assert got.finish_reason == "length", label


def test_reference_covers_eos_and_length(hf_reference):
    # The comparison is only meaningful if some prompts stop at EOS and some run to the limit.
    ends = [tokens[-1] == EOS for tokens, _ in hf_reference]
    assert any(ends) and not all(ends)


def test_chat_prompt_ids_match_hf_template(batched, prompt_ids):
    assert [o.prompt_token_ids for o in batched] == prompt_ids


def test_batched_greedy_matches_hf(batched, hf_reference):
    for i, (out, (ref, _)) in enumerate(zip(batched, hf_reference, strict=True)):
        _assert_same_as_hf(out, ref, f"prompt {i}")


def test_one_at_a_time_greedy_matches_hf(engine, prompt_ids, hf_reference):
    # alone in the engine, the first prompt HF ends at EOS and the first it runs to the limit
    # (the batched test covers all nine)
    ends = [tokens[-1] == EOS for tokens, _ in hf_reference]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    for i in (ends.index(True), ends.index(False)):
        [out] = engine.generate(prompt_token_ids=[prompt_ids[i]], sampling_params=params)
        _assert_same_as_hf(out, hf_reference[i][0], f"prompt {i}")


LONG_TEXTS = [
    "The history of the bicycle begins in the early nineteenth century, when inventors in "
    "Germany and France built wooden running machines that riders pushed along with their feet. "
    "Pedals, chains and pneumatic tyres came later, and by the end of the century the safety "
    "bicycle, with two wheels of equal size and a chain driving the rear one, had become the "
    "machine we know today. Its success changed how people",
    "A recipe for bread needs flour, water, salt and yeast. Mix them into a dough, knead it for "
    "ten minutes until it is smooth and elastic, let it rise in a warm place for an hour, shape "
    "it into a loaf, let it rise again and then bake it in a hot oven. The crust should be "
    "deep brown and the loaf should sound hollow when you tap its base. Before slicing it, "
    "you should",
]


@pytest.mark.slow  # a second SmolLM2 engine; `make test` keeps the claim on every family's
# tiny checkpoint (tests/model/test_families_hf.py::test_engine_greedy_tokens_match_hf)
def test_a_32_token_budget_chunks_prompts_and_keeps_hf_tokens(hf_model, hf_tokenizer):
    """max_num_batched_tokens=32 with prompts of 60+ tokens: no step carries more than 32
    tokens, prompts are prefilled in several chunks mixed with decode tokens, and the greedy
    tokens are still HF's."""
    from conftest import ENGINE_KWARGS

    from jaxpipe import Engine, EngineConfig

    ids = [hf_tokenizer(t)["input_ids"] for t in LONG_TEXTS]
    assert min(map(len, ids)) >= 60
    engine = Engine(EngineConfig(**{**ENGINE_KWARGS, "max_num_batched_tokens": 32},
                                 scheduler="prefill_first"))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outs = engine.generate(prompt_token_ids=ids, sampling_params=params)
    for i, (prompt, out) in enumerate(zip(ids, outs, strict=True)):
        _assert_same_as_hf(out, _hf_greedy(hf_model, prompt)[0], f"prompt {i}")
    stats = engine.stats()
    assert stats["max_step_tokens"] <= 32
    assert stats["prefill_chunks"] >= sum(-(-len(p) // 32) for p in ids)
    assert stats["decode_tokens"] > 0


def test_logprobs_match_hf(batched, hf_reference):
    for out, (_, ref_lp) in zip(batched, hf_reference, strict=True):
        got = out.outputs[0]
        assert len(got.logprobs) == len(got.token_ids)
        for step, (token, entry) in enumerate(zip(got.token_ids, got.logprobs, strict=True)):
            fifth = np.sort(ref_lp[step])[-5]
            assert token in entry
            for tid, lp in entry.items():
                assert lp == pytest.approx(ref_lp[step, tid], abs=2 * LOGITS_ATOL)
            assert min(entry.values()) >= fifth - 2 * LOGITS_ATOL  # they are HF's top 5


def test_repetition_penalty_matches_hf(engine, hf_model, prompt_ids):
    # HF's RepetitionPenaltyLogitsProcessor and vLLM's penalty are the same formula, applied
    # over prompt + output. A plain greedy request shares the batch to check it is per row.
    chosen = [prompt_ids[1], prompt_ids[4]]
    want = []
    for ids in chosen:
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    do_sample=False, max_new_tokens=16, pad_token_id=EOS,
                                    repetition_penalty=1.3)
        want.append(out[0, len(ids):].tolist())
    params = SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3)
    outs = engine.generate(prompt_token_ids=chosen + [prompt_ids[1]],
                           sampling_params=[params, params, SamplingParams(temperature=0.0,
                                                                           max_tokens=16)])
    assert [o.outputs[0].token_ids for o in outs[:2]] == want
    assert outs[2].outputs[0].token_ids != want[0]  # the penalty made a difference


# ---- the ragged step (runner level) against HF logits -------------------------------------------


@pytest.fixture(scope="module")
def runner(gguf_weights):
    """A one-device runner (f32, XLA attention: the reference path) over a 21-block pool."""
    import jax

    from jaxpipe.config.layout import Layout
    from jaxpipe.runtime.buckets import Buckets
    from jaxpipe.runtime.runner import Runner

    cfg, values = gguf_weights
    one = {"prefill": Layout(), "decode": Layout()}
    return Runner(cfg, values, Buckets.for_engine(4, 64, 64), 4, 64, jnp.float32, one,
                  jax.devices()[:1], num_blocks=POOL, attention="xla")


@pytest.fixture(scope="module")
def plain_ids(hf_tokenizer) -> list[list[int]]:
    ids = [hf_tokenizer(t)["input_ids"] for t in PLAIN_TEXTS]
    assert len({len(i) for i in ids}) == len(ids)  # mixed lengths
    return ids


@pytest.fixture(scope="module")
def hf_last(hf_model, plain_ids) -> list[np.ndarray]:
    """HF's last-position logits of each plain prompt."""
    return [_hf_last_logits(hf_model, ids) for ids in plain_ids]


# Block tables of 4 sequences x 64 positions (4 blocks of 16) scattered over a pool of 21
# blocks, out of order: the KV of each sequence is paged, not contiguous.
TABLE = np.random.default_rng(5).permutation(21)[:16].reshape(4, 4).astype(np.int32)
POOL = 21


def run_step(runner, pieces) -> np.ndarray:
    """Logits [len(pieces), V] of each piece's last token, all pieces in one ragged step."""
    from jaxpipe.runtime import step_inputs

    tokens = runner.buckets.tokens(sum(len(p.tokens) for p in pieces))
    inputs = step_inputs.build(pieces, tokens, runner.buckets.rows(tokens),
                               runner.max_blocks)
    return np.asarray(runner.logits(inputs, len(pieces)))


def piece(ids, start: int, row: int):
    from jaxpipe.runtime.step_inputs import Piece

    return Piece(list(ids), start, list(TABLE[row]))


def test_ragged_prefill_logits_match_hf(runner, plain_ids, hf_last):
    logits = run_step(runner, [piece(ids, 0, row) for row, ids in enumerate(plain_ids)])
    assert logits.shape == (3, runner.config.vocab_size)
    for row, ref in enumerate(hf_last):
        np.testing.assert_allclose(logits[row], ref, rtol=0, atol=LOGITS_ATOL,
                                   err_msg=f"row {row}")


def test_decode_after_prefill_matches_hf(runner, hf_model, plain_ids, hf_last):
    run_step(runner, [piece(ids, 0, row) for row, ids in enumerate(plain_ids)])
    nxt = [int(np.argmax(h)) for h in hf_last]
    # Decode tokens in another order than the prefill's rows: rows follow the pieces.
    order = [2, 0, 1]
    logits = run_step(runner, [piece([nxt[i]], len(plain_ids[i]), i) for i in order])
    for row, i in enumerate(order):
        np.testing.assert_allclose(logits[row], _hf_last_logits(hf_model, plain_ids[i] + [nxt[i]]),
                                   rtol=0, atol=LOGITS_ATOL, err_msg=f"prompt {i}")


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_logits_equal_unchunked(runner, plain_ids, chunk):
    """A prompt prefilled in chunks over several steps ends with the logits (f32, 1e-4) of
    the whole prompt in one step."""
    ids = plain_ids[1]
    whole = run_step(runner, [piece(ids, 0, 0)])[0]
    for start in range(0, len(ids), chunk):
        logits = run_step(runner, [piece(ids[start:start + chunk], start, 1)])[0]
    np.testing.assert_allclose(logits, whole, rtol=0, atol=1e-4)


def test_mixed_step_equals_separate_steps(runner, plain_ids):
    """One step carrying a prompt chunk of one sequence and a decode token of another gives
    the logits of running them in separate steps."""
    a, b = plain_ids[1], plain_ids[0]
    run_step(runner, [piece(a[:20], 0, 0), piece(b, 0, 1)])  # a part-way, b prefilled
    separate = [run_step(runner, [piece(a[20:], 20, 0)])[0],
                run_step(runner, [piece([7], len(b), 1)])[0]]
    run_step(runner, [piece(a[:20], 0, 2), piece(b, 0, 3)])
    mixed = run_step(runner, [piece([7], len(b), 3), piece(a[20:], 20, 2)])
    np.testing.assert_allclose(mixed[0], separate[1], rtol=0, atol=1e-4)
    np.testing.assert_allclose(mixed[1], separate[0], rtol=0, atol=1e-4)


def test_whole_sequence_forward_matches_hf(gguf_weights, hf_model, plain_ids, hf_last):
    """`Decoder.forward`, the cache-free reference other tests compare the step with."""
    from jaxpipe.model.decoder import Decoder

    cfg, values = gguf_weights
    model = Decoder(cfg, dtype=jnp.float32, values=values)
    logits = np.asarray(model.forward(jnp.asarray([plain_ids[1]])))[0, -1]
    np.testing.assert_allclose(logits, hf_last[1], rtol=0, atol=LOGITS_ATOL)
