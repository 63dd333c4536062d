"""Completions with `echo` and `logprobs` on the shared server (f32 SmolLM2), called with the
official `openai` client as lm-evaluation-harness's local-completions calls it: the prompt's
tokens, logprobs (None first) and text offsets before the completion's, in OpenAI's legacy
shape; the prompt's logprobs equal HF transformers' log-softmax (1e-4); max_tokens=0 scores
without generating."""

from __future__ import annotations

import numpy as np
import pytest

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
from hf_families import hf_log_softmax  # noqa: E402

MODEL = "smollm2-135m"
TEXT = "The capital of France is Paris, and the capital of Italy is"
ATOL = 1e-4


@pytest.fixture(scope="module")
def ids(hf_tokenizer):
    return hf_tokenizer.encode(TEXT, add_special_tokens=False)


@pytest.fixture(scope="module")
def want(hf_model, ids):
    """HF's logprob of each prompt token after the first."""
    lp = hf_log_softmax(hf_model, ids)
    return np.array([lp[t - 1, ids[t]] for t in range(1, len(ids))])


def assert_echoed(choice, ids, want, prompt_text: str, completion_tokens: int) -> None:
    """`choice` holds the prompt then `completion_tokens` tokens, in the legacy shape."""
    lp, n = choice.logprobs, len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(
        lp.text_offset) == n + completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:n], want, atol=ATOL, rtol=0)
    for t in range(1, n):  # the top alternative, and the prompt's own token
        assert lp.top_logprobs[t][lp.tokens[t]] == lp.token_logprobs[t]
        assert max(lp.top_logprobs[t].values()) >= lp.token_logprobs[t]
    assert choice.text.startswith(prompt_text)
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]


def test_echo_logprobs_of_a_text_prompt(client, ids, want):
    out = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=3, temperature=0,
                                    echo=True, logprobs=1)
    [choice] = out.choices
    assert_echoed(choice, ids, want, TEXT, 3)
    assert out.usage.completion_tokens == 3


def test_echo_logprobs_of_a_token_id_prompt(client, ids, want):
    """lm-evaluation-harness sends token ids, echo, logprobs=1 and max_tokens=1."""
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                    echo=True, logprobs=1)
    [choice] = out.choices
    assert_echoed(choice, ids, want, TEXT, 1)


def test_scoring_with_max_tokens_0(client, ids, want):
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True,
                                    logprobs=2)
    [choice] = out.choices
    assert_echoed(choice, ids, want, TEXT, 0)
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0
    assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs[1:])


def test_streamed_echo_equals_the_whole_response(client):
    kw = dict(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0, echo=True, logprobs=1)
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    joined = {k: sum((getattr(c.logprobs, k) for c in chunks if c.logprobs), [])
              for k in ("tokens", "token_logprobs", "text_offset")}
    assert joined == {k: getattr(whole.logprobs, k) for k in joined}


def test_max_tokens_0_without_echo_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=TEXT, max_tokens=0)
