"""Structured outputs in the engine (`engine/structured.py`, `request/grammar.py`): every token
a constrained request samples is one its grammar allows, checked by llguidance's own matcher
built here from HF's tokenizer (independent of the engine's masks); a greedy constrained run
equals HF transformers' greedy decoding with its logits masked by that matcher; the outputs
hold through overlap on and off, both `constrained_steps`, the host sampler, n samples,
preemption (recompute and swap) and seesaw's host tier; a constraint that does not compile is
refused naming its field, and the engine serves on."""

from __future__ import annotations

import llguidance.hf
import llguidance.numpy as llg_numpy
import numpy as np
import pytest
from structured_workload import (
    CONSTRAINTS,
    EOS,
    PROMPTS,
    VOCAB,
    assert_allowed,
    assert_text_fits,
    constrained,
    matcher,
    mixed_run,
)

from jaxpipe import Engine, EngineConfig, SamplingParams
from jaxpipe.request.errors import RequestError


@pytest.fixture(scope="module")
def reference_tokenizer(hf_tokenizer):
    """llguidance's tokenizer read from HF's (not from the engine's)."""
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=VOCAB, eos_token=EOS)


@pytest.fixture(scope="module")
def tiny(tiny_smollm2):
    from conftest import ENGINE_KWARGS

    engine = Engine(EngineConfig(**{**ENGINE_KWARGS, "model": tiny_smollm2}))
    yield engine
    engine.close()


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_every_sampled_token_is_allowed_by_the_grammar(tiny, reference_tokenizer, kind):
    """The random two-layer model at temperature 1 strays everywhere the masks let it."""
    params = [constrained(kind, temperature=1.0, max_tokens=40, seed=seed) for seed in range(6)]
    outs = tiny.generate(PROMPTS[:3] * 2, params)
    for out in outs:
        assert_allowed(reference_tokenizer, kind, out.outputs[0], 40)
    assert any(o.outputs[0].finish_reason == "stop" for o in outs) or kind == "json_object"


def hf_masked_greedy(hf_model, reference_tokenizer, kind: str, ids: list[int],
                     max_tokens: int) -> list[int]:
    """HF's greedy tokens with the logits masked by llguidance's matcher, until the grammar
    is complete or max_tokens."""
    import torch

    m, out = matcher(reference_tokenizer, kind), []
    mask = llg_numpy.allocate_token_bitmask(1, VOCAB)
    with torch.no_grad():
        while len(out) < max_tokens and not m.is_stopped():
            logits = hf_model(torch.tensor([ids + out])).logits[0, -1].double().numpy()
            llg_numpy.fill_next_token_bitmask(m, mask)
            bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:VOCAB]
            token = int(np.argmax(np.where(bits == 1, logits, -np.inf)))
            if token == EOS:
                break
            assert m.consume_token(token)
            out.append(token)
    return out


@pytest.mark.parametrize("kind", ["json", "regex", "choice"])
def test_greedy_constrained_run_equals_hf_masked_by_the_same_grammar(
        engine, hf_model, hf_tokenizer, reference_tokenizer, kind):
    prompt = {"json": "Describe Alice, who is 30, as JSON:", "regex": "Is water wet?",
              "choice": "Which letter comes first?"}[kind]
    ids = hf_tokenizer.encode(prompt, add_special_tokens=False)
    [out] = engine.generate(prompt_token_ids=[ids],
                            sampling_params=constrained(kind, temperature=0.0, max_tokens=30))
    got = [t for t in out.outputs[0].token_ids if t != EOS]
    assert got == hf_masked_greedy(hf_model, reference_tokenizer, kind, ids, 30)
    assert_text_fits(kind, out.outputs[0].text)


@pytest.fixture(scope="module")
def mixed_reference(tiny):
    tiny.set_overlap(False)
    try:
        return mixed_run(tiny)
    finally:
        tiny.set_overlap(True)


def test_overlap_keeps_every_output(tiny, mixed_reference):
    assert mixed_run(tiny) == mixed_reference


@pytest.mark.parametrize("fields", [
    dict(constrained_steps="land"),
    dict(sampler="host"),
    dict(kv_cache_tokens=128, max_model_len=64),  # preemption recomputes
    dict(kv_cache_tokens=128, max_model_len=64, host_kv_tokens=4096),  # swaps to the host tier
    dict(kv_cache_tokens=1024, host_kv_tokens=4096, scheduler="seesaw"),
], ids=["land", "host-sampler", "recompute", "swap", "seesaw"])
def test_outputs_hold_through_every_engine_path(tiny_smollm2, mixed_reference, fields):
    from conftest import ENGINE_KWARGS

    engine = Engine(EngineConfig(**{**ENGINE_KWARGS, "model": tiny_smollm2, **fields}))
    try:
        engine.reset_stats()
        assert mixed_run(engine) == mixed_reference
        if fields.get("kv_cache_tokens") == 128:
            assert engine.stats()["preemptions"] > 0
    finally:
        engine.close()


def test_each_of_n_samples_follows_its_own_grammar_state(tiny, reference_tokenizer):
    [out] = tiny.generate(["Numbers:"], constrained("grammar", temperature=1.0, max_tokens=30,
                                                    n=4, seed=7))
    for c in out.outputs:
        assert_allowed(reference_tokenizer, "grammar", c, 30)
    [alone] = tiny.generate(["Numbers:"], constrained("grammar", temperature=1.0,
                                                      max_tokens=30, seed=9))
    assert out.outputs[2].token_ids == alone.outputs[0].token_ids  # sample i: seed + i


@pytest.mark.parametrize("so, field", [
    ({"json": {"type": "bogus"}}, "sampling.structured_outputs.json"),
    ({"regex": "(["}, "sampling.structured_outputs.regex"),
    ({"grammar": "start: undefined_rule"}, "sampling.structured_outputs.grammar"),
])
def test_a_constraint_that_does_not_compile_is_refused_and_the_engine_serves_on(tiny, so,
                                                                                field):
    with pytest.raises(RequestError) as e:
        tiny.add_request("x", SamplingParams(structured_outputs=so))
    assert e.value.field == field
    assert not tiny.has_unfinished()
    [out] = tiny.generate(["Pick one:"], constrained("choice", temperature=0.0))
    assert out.outputs[0].text in CONSTRAINTS["choice"]["choice"]


@pytest.mark.parametrize("so", [{}, {"regex": "a", "choice": ["b"]}, {"xml": "<a/>"},
                                {"choice": []}, {"json": "[1"}])
def test_malformed_structured_outputs_are_refused_naming_the_field(so):
    with pytest.raises((ValueError, TypeError), match="structured_outputs"):
        SamplingParams(structured_outputs=so)


def test_a_batch_of_constrained_decodes_alternates_in_two_halves(tiny_smollm2):
    """32 constrained sequences and nothing else: with overlap, half of them go in a step while
    the other half's tokens land (so about twice the steps of landing each step first), and
    every token is the same."""
    from conftest import ENGINE_KWARGS

    engine = Engine(EngineConfig(**{**ENGINE_KWARGS, "model": tiny_smollm2,
                                    "max_num_seqs": 32}))
    spaced = {"regex": "[a-z]( [a-z]){20}"}  # about 21 tokens each: halves stay full
    params = [SamplingParams(structured_outputs=spaced, temperature=1.0, max_tokens=40, seed=s)
              for s in range(32)]
    try:
        runs = {}
        for overlap in (False, True):
            engine.set_overlap(overlap)
            engine.reset_stats()
            outs = engine.generate(["Numbers:"] * 32, params)
            runs[overlap] = ([o.outputs[0].token_ids for o in outs], engine.stats()["steps"])
        assert runs[True][0] == runs[False][0]
        assert runs[True][1] >= 1.6 * runs[False][1]
    finally:
        engine.close()



def test_a_models_own_end_token_may_end_a_grammar(tiny):
    """A model whose end of turn is not its tokenizer's EOS (Llama 3's <|eot_id|>): wherever the
    grammar may end, the mask allows the model's end tokens too; nowhere else."""
    from jaxpipe.engine.structured import Constraints
    from jaxpipe.scheduler import Sequence

    so = {"regex": "[a-z]+"}
    word = tiny.tokenizer.encode("abc", add_special_tokens=False)

    def allowed(constraints, consumed):
        seq = Sequence.create("probe", [1], SamplingParams(structured_outputs=so), 0, 8)
        constraints.attach([seq])
        assert seq.grammar.consume_tokens(consumed)
        bits = np.unpackbits(constraints.masks([seq])[0].view(np.uint8), bitorder="little")
        return set(np.flatnonzero(bits).tolist())

    two_ends = Constraints(tiny.tokenizer, VOCAB, eos_ids=(1, EOS))
    assert {1, EOS} <= allowed(two_ends, word)  # "abc" may end here
    assert not {1, EOS} & allowed(two_ends, [])  # the regex needs a letter first
    assert EOS in allowed(tiny.executor.constraints, word)
    assert 1 not in allowed(tiny.executor.constraints, word)  # this model ends on EOS only
