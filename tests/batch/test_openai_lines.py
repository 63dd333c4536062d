"""Batch lines (JSONL jobs and the Batch API) read vLLM's request parameters through the same
OpenAI body reader as the HTTP server: they reach SamplingParams, and bad values are refused
naming the body key."""

from __future__ import annotations

import pytest

from jaxpipe.batch.openai import body_field, parse_line
from jaxpipe.request.errors import RequestError
from jaxpipe.request.validate import Limits, prepare

LIMITS = Limits(max_model_len=64, vocab_size=1000)


def line(**body) -> dict:
    return {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"model": "m", "prompt": [1, 2, 3, 4], **body}}


def test_the_new_parameters_reach_sampling_params():
    item = parse_line(line(logit_bias={"7": 100, "9": -5}, allowed_token_ids=[7, 9],
                           bad_words=["x"], truncate_prompt_tokens=2,
                           include_stop_str_in_output=True, best_of=1), 1)
    sampling = dict(item.sampling)
    sampling.pop("bad_words")  # needs the model's tokenizer: checked in the engine tests
    prep = prepare(item.kind, item.prompt, sampling, None, LIMITS)
    p = prep.params
    assert p.logit_bias == {7: 100.0, 9: -5.0} and p.allowed_token_ids == (7, 9)
    assert p.include_stop_str_in_output and p.best_of == 1
    assert prep.prompt_token_ids == [3, 4]
    assert item.sampling["bad_words"] == ["x"]


@pytest.mark.parametrize("body, key", [
    ({"best_of": 2}, "body.best_of"),
    ({"logit_bias": {"7": -100.5}}, "body.logit_bias"),
    ({"allowed_token_ids": []}, "body.allowed_token_ids"),
    ({"truncate_prompt_tokens": 0}, "body.truncate_prompt_tokens"),
    ({"include_stop_str_in_output": 1}, "body.include_stop_str_in_output"),
])
def test_bad_values_name_the_body_key(body, key):
    item = parse_line(line(**body), 1)
    with pytest.raises(RequestError) as info:
        prepare(item.kind, item.prompt, item.sampling, None, LIMITS)
    assert body_field(info.value.field) == key
