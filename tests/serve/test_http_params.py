"""vLLM's request parameters through the shared server's front ends: `logit_bias` and
`best_of` with the official `openai` client (OpenAI's own parameters), the vLLM extras
(allowed_token_ids, bad_words, truncate_prompt_tokens, include_stop_str_in_output) in its
`extra_body`, and the new proto fields over gRPC. Expected outputs come from the same server's
plain greedy answer and Python string / list operations."""

from __future__ import annotations

import grpc
import pytest

from jaxpipe.model.tokenizer import Tokenizer
from jaxpipe.protocol import jaxpipe_pb2 as pb
from jaxpipe.protocol import jaxpipe_pb2_grpc as pb_grpc

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tok(gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


def complete(client, **kw):
    return client.completions.create(**{"model": MODEL, "prompt": PROMPT, "temperature": 0,
                                        "max_tokens": 6, **kw})


def first_token_logprobs(client, **kw) -> dict[str, float]:
    """The sampled first token's text -> raw logprob, and its top-5 alternatives."""
    resp = complete(client, max_tokens=1, logprobs=5, **kw)
    lp = resp.choices[0].logprobs
    return lp.tokens[0], lp.top_logprobs[0]


def test_logit_bias_moves_a_tokens_probability_as_asked(client, tok):
    plain, top = first_token_logprobs(client)
    runner_up = sorted(top, key=top.get)[-2]  # the second most likely first token
    assert runner_up != plain
    bid = tok.encode(runner_up, add_special_tokens=False)
    assert len(bid) == 1
    chosen, _ = first_token_logprobs(client, logit_bias={str(bid[0]): 100})
    assert chosen == runner_up  # +100 makes it the argmax
    first = tok.encode(plain, add_special_tokens=False)[0]
    chosen, _ = first_token_logprobs(client, logit_bias={str(first): -100})
    assert chosen != plain  # -100 takes the argmax away
    banana = tok.encode(" banana", add_special_tokens=False)[0]
    forced = complete(client, temperature=1.0, seed=5, max_tokens=4,
                      logit_bias={str(banana): 100})
    assert forced.choices[0].text == " banana" * 4
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=3,
        logit_bias={str(banana): 100})
    assert chat.choices[0].message.content == " banana" * 3


def test_best_of_is_refused_naming_it_and_the_server_serves_on(client):
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, best_of=3)
    assert info.value.param == "best_of" and "vLLM V1 dropped best_of" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, logit_bias={"5": 101})
    assert info.value.param == "logit_bias" and "[-100, 100]" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, extra_body={"allowed_token_ids": [1, 10**6]})
    assert info.value.param == "allowed_token_ids" and "vocabulary" in info.value.message
    assert complete(client, best_of=1).choices[0].text


def test_vllm_extras_in_extra_body(client, tok):
    plain = complete(client, max_tokens=12).choices[0].text
    stop = plain[4:9]
    kept = complete(client, max_tokens=12, stop=[stop],
                    extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.text == plain[:plain.index(stop) + len(stop)]
    allowed = tok.encode(" one two three", add_special_tokens=False)
    out = complete(client, temperature=1.0, seed=1, max_tokens=5,
                   extra_body={"allowed_token_ids": allowed}).choices[0].text
    assert set(tok.encode(out, add_special_tokens=False)) <= set(allowed)
    word = plain.split()[0]
    banned = complete(client, max_tokens=12, extra_body={"bad_words": [word]}).choices[0].text
    assert banned != plain and word not in banned.split()
    long_prompt = "Ignore this. " * 10 + PROMPT
    n = len(tok.encode(PROMPT))
    truncated = complete(client, prompt=long_prompt, extra_body={"truncate_prompt_tokens": n})
    assert truncated.usage.prompt_tokens == n
    tail = tok.encode(long_prompt)[-n:]
    assert truncated.choices[0].text == complete(client, prompt=tail).choices[0].text


def test_grpc_fields_reach_the_engine(grpc_server, tok):
    banana = tok.encode(" banana", add_special_tokens=False)[0]
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=3, logit_bias={banana: 100.0})
    with grpc.insecure_channel(grpc_server.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        text = "".join(r.text for r in stub.Generate(pb.GenerateRequest(text=PROMPT,
                                                                        sampling=sampling)))
        assert text == " banana" * 3
        bad = pb.SamplingParams(max_tokens=3, best_of=2)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=bad)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "best_of" in info.value.details()
