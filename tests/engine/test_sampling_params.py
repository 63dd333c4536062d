"""vLLM's request parameters beyond the sampler's numbers, end to end on the shared f32 SmolLM2
engine (overlap on, its default): bad_words against an HF transformers greedy loop with the same
bans applied in NumPy; logit_bias and allowed_token_ids; truncate_prompt_tokens against the
truncated prompt; include_stop_str_in_output against the plain output's text."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpipe import SamplingParams

EOS = 2
TOKENS = 20
PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of"


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": TOKENS, **kwargs})


def run(engine, ids, params):
    [out] = engine.generate(prompt_token_ids=[ids], sampling_params=params)
    return out.outputs[0]


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    return engine.tokenizer.encode(PROMPT)


@pytest.fixture(scope="module")
def plain(engine, prompt):
    assert engine.config.overlap  # the bad-word bans must hold with steps overlapped
    return run(engine, prompt, greedy())


def _word_ids(tok, word: str) -> list[list[int]]:
    """The test's own statement of vLLM's bad-word tokenization: as written and, when it is
    another token sequence of the same length, with a leading space."""
    plain = tok.encode(word, add_special_tokens=False)
    spaced = tok.encode(" " + word, add_special_tokens=False)
    return [plain] + ([spaced] if len(spaced) == len(plain) and spaced[0] != plain[0] else [])


def _multi_token_word(tok, ids: list[int]) -> str:
    """A word of the greedy output that is several tokens, spelled there as its spaced form."""
    for word in tok.decode(ids).split():
        spaced = tok.encode(" " + word, add_special_tokens=False)
        if len(spaced) > 1 and any(ids[i:i + len(spaced)] == spaced for i in range(len(ids))):
            return word
    pytest.fail(f"no multi-token word in {tok.decode(ids)!r}")


def _hf_greedy_with_bans(hf_model, prompt: list[int], words: list[list[int]]) -> list[int]:
    """HF's greedy loop; before each argmax the logits of vLLM's banned ids (a one-token word
    always, a longer word's last token when the output ends with its other tokens) -> -inf."""
    import torch

    out: list[int] = []
    past, feed = None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(TOKENS):
            res = hf_model(feed, past_key_values=past, use_cache=True)
            past, logits = res.past_key_values, res.logits[0, -1].float().numpy()
            for w in words:
                if len(w) - 1 <= len(out) and out[len(out) - len(w) + 1:] == w[:-1]:
                    logits[w[-1]] = -np.inf
            out.append(int(np.argmax(logits)))
            if out[-1] == EOS:
                break
            feed = torch.tensor([[out[-1]]])
    return out


def test_bad_words_match_hf_greedy_with_the_same_bans(engine, prompt, plain, hf_model):
    tok = engine.tokenizer
    multi = _multi_token_word(tok, plain.token_ids)
    single = next(w for w in tok.decode(plain.token_ids).split()
                  if len(tok.encode(" " + w, add_special_tokens=False)) == 1)
    for words in ([multi], [single, multi]):
        ids = [w for word in words for w in _word_ids(tok, word)]
        assert any(len(w) > 1 for w in ids)  # the bans that read the newest tokens
        out = run(engine, prompt, greedy(bad_words=words))
        assert out.token_ids != plain.token_ids
        for w in ids:  # the banned sequences never appear
            assert not any(out.token_ids[i:i + len(w)] == w
                           for i in range(len(out.token_ids)))
        assert out.token_ids == _hf_greedy_with_bans(hf_model, prompt, ids)


def test_logit_bias_forces_and_removes_tokens(engine, prompt, plain):
    first = plain.token_ids[0]
    out = run(engine, prompt, greedy(logit_bias={first: -100}))
    assert out.token_ids[0] != first
    forced = engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    out = run(engine, prompt, greedy(max_tokens=3, logit_bias={str(forced): 100}))
    assert out.token_ids == [forced] * 3


def test_allowed_token_ids_limit_every_token(engine, prompt, plain):
    allowed = sorted(set(plain.token_ids[5:10]) | {13, 17})
    out = run(engine, prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=8,
                                             allowed_token_ids=allowed))
    assert len(out.token_ids) == 8 and set(out.token_ids) <= set(allowed)


def test_truncate_prompt_tokens_is_the_truncated_prompt(engine, prompt):
    k = 9
    whole = engine.generate([PROMPT], greedy(truncate_prompt_tokens=k))[0]
    short = run(engine, prompt[-k:], greedy())
    assert whole.prompt_token_ids == prompt[-k:]
    assert whole.outputs[0].token_ids == short.token_ids


def test_include_stop_str_in_output_keeps_the_stop_string(engine, prompt, plain):
    text = plain.text
    stop = text[len(text) // 2:len(text) // 2 + 5]
    out = run(engine, prompt, greedy(stop=[stop], include_stop_str_in_output=True))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop) + len(stop)]
    cut = run(engine, prompt, greedy(stop=[stop]))
    assert cut.text + stop == out.text
