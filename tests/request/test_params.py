"""The sampling parameters vLLM has beyond the sampler's numbers: logit_bias,
allowed_token_ids, bad_words, truncate_prompt_tokens, include_stop_str_in_output and best_of
(refused): their normalisation, and every bad value refused with an error naming the field and
what is accepted, by SamplingParams and by `validate.prepare` (the model's vocabulary)."""

from __future__ import annotations

import pytest

from jaxpipe.request.errors import RequestError
from jaxpipe.request.params import SamplingParams
from jaxpipe.request.validate import Limits, prepare

LIMITS = Limits(max_model_len=64, vocab_size=1000)


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.logit_bias, p.allowed_token_ids, p.bad_words) == (None, None, ())
    assert (p.truncate_prompt_tokens, p.include_stop_str_in_output, p.best_of) == (
        None, False, None)
    p = SamplingParams(logit_bias={"12": 5, 3: -100, "7": 100.0}, allowed_token_ids=[9, 2, 9],
                       bad_words=["hello", " big world"], truncate_prompt_tokens=5,
                       include_stop_str_in_output=True, best_of=1)
    assert p.logit_bias == {12: 5.0, 3: -100.0, 7: 100.0}  # OpenAI's string keys -> ints
    assert all(type(k) is int for k in p.logit_bias)
    assert p.allowed_token_ids == (2, 9) and p.bad_words == ("hello", " big world")
    assert p.truncate_prompt_tokens == 5 and p.include_stop_str_in_output


@pytest.mark.parametrize("field, value, accepted", [
    ("logit_bias", {5: 100.5}, r"\[-100, 100\]"),
    ("logit_bias", {5: -101}, r"\[-100, 100\]"),
    ("logit_bias", {5: float("nan")}, "finite"),
    ("logit_bias", {5: "big"}, "number"),
    ("logit_bias", {-1: 1.0}, "ints >= 0"),
    ("logit_bias", {"x": 1.0}, "ints >= 0"),
    ("logit_bias", [5, 1.0], "dict"),
    ("allowed_token_ids", [], "non-empty"),
    ("allowed_token_ids", 5, "non-empty list"),
    ("allowed_token_ids", [1, -2], "ints >= 0"),
    ("allowed_token_ids", [1, "2"], "ints >= 0"),
    ("bad_words", "word", "list of str"),
    ("bad_words", ["ok", ""], "non-blank"),
    ("bad_words", [3], "non-blank strings"),
    ("truncate_prompt_tokens", 0, ">= 1"),
    ("truncate_prompt_tokens", -1, ">= 1"),
    ("truncate_prompt_tokens", 2.5, "integer"),
    ("include_stop_str_in_output", "yes", "bool"),
    ("best_of", 2, "vLLM V1 dropped best_of"),
    ("best_of", 0, "vLLM V1 dropped best_of; ask for n"),
    ("best_of", 1.5, "integer"),
])
def test_bad_values_name_the_field_and_what_is_accepted(field, value, accepted):
    with pytest.raises((ValueError, TypeError), match=accepted) as info:
        SamplingParams(**{field: value})
    assert str(info.value).startswith(field)
    with pytest.raises(RequestError) as info:  # and the request validator's field name
        prepare("token_ids", [1, 2], {field: value}, None, LIMITS)
    assert info.value.field == f"sampling.{field}"


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {1000: 1.0}), ("logit_bias", {"999": 1.0, "5000": -1.0}),
    ("allowed_token_ids", [0, 1000]),
])
def test_ids_outside_the_vocabulary_are_refused(field, value):
    with pytest.raises(RequestError, match=r"outside the vocabulary \[0, 1000\)") as info:
        prepare("token_ids", [1], {field: value}, None, LIMITS)
    assert info.value.field == f"sampling.{field}"


def test_truncate_prompt_tokens_keeps_the_last_k_before_the_length_checks():
    prompt = list(range(1, 101))  # longer than max_model_len=64: refused untruncated
    with pytest.raises(RequestError, match="max_model_len"):
        prepare("token_ids", prompt, {}, None, LIMITS)
    prep = prepare("token_ids", prompt, {"truncate_prompt_tokens": 10, "max_tokens": 54},
                   None, LIMITS)
    assert prep.prompt_token_ids == prompt[-10:]
    assert prepare("token_ids", [5, 6], {"truncate_prompt_tokens": 10}, None,
                   LIMITS).prompt_token_ids == [5, 6]
    with pytest.raises(RequestError, match="max_tokens"):  # the room is the truncated prompt's
        prepare("token_ids", prompt, {"truncate_prompt_tokens": 10, "max_tokens": 55}, None,
                LIMITS)


def test_best_of_equal_to_n_is_accepted():
    assert SamplingParams(best_of=1).best_of == 1


def test_bad_words_need_a_tokenizer():
    with pytest.raises(RequestError, match="tokenizer") as info:
        prepare("token_ids", [1], {"bad_words": ["x"]}, None, LIMITS)
    assert info.value.field == "sampling.bad_words"


def test_prompt_logprobs_are_refused_with_several_samples():
    with pytest.raises(ValueError, match=r"^prompt_logprobs needs n=1.*got n=2"):
        SamplingParams(n=2, prompt_logprobs=1)
    assert SamplingParams(n=2).prompt_logprobs is None
