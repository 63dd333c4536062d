"""jaxpipe.serve.protos: a gRPC request's SamplingParams message -> SamplingParams fields, with
vLLM's list and map parameters (logit_bias, allowed_token_ids, bad_words) and the optional
scalars (truncate_prompt_tokens, include_stop_str_in_output, best_of)."""

from __future__ import annotations

import pytest

from jaxpipe.protocol import jaxpipe_pb2 as pb
from jaxpipe.request.errors import RequestError
from jaxpipe.request.params import SamplingParams
from jaxpipe.request.validate import Limits, prepare
from jaxpipe.serve import protos

LIMITS = Limits(max_model_len=64, vocab_size=1000)


def request(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                              sampling=pb.SamplingParams(**sampling))


def test_every_new_field_reaches_sampling_params():
    msg = request(temperature=0.0, logit_bias={7: 100.0, 12: -2.5},
                  allowed_token_ids=[3, 7, 12], bad_words=["foo", "bar baz"],
                  truncate_prompt_tokens=2, include_stop_str_in_output=True, best_of=1,
                  stop=["x"], stop_token_ids=[5])
    protos.check_known_fields(msg)  # a map field is not an unknown one
    params = SamplingParams(**protos.sampling_of(msg))
    assert params.logit_bias == {7: 100.0, 12: -2.5}
    assert params.allowed_token_ids == (3, 7, 12)
    assert params.bad_words == ("foo", "bar baz")
    assert (params.truncate_prompt_tokens, params.include_stop_str_in_output,
            params.best_of) == (2, True, 1)
    assert params.stop == ("x",) and params.stop_token_ids == (5,)


def test_unset_fields_keep_the_defaults():
    fields = protos.sampling_of(request(temperature=0.5))
    assert fields == {"temperature": 0.5}
    assert SamplingParams(**fields).logit_bias is None


@pytest.mark.parametrize("sampling, field", [
    ({"logit_bias": {7: 150.0}}, "sampling.logit_bias"),
    ({"logit_bias": {5000: 1.0}}, "sampling.logit_bias"),
    ({"allowed_token_ids": [1, 1000]}, "sampling.allowed_token_ids"),
    ({"truncate_prompt_tokens": 0}, "sampling.truncate_prompt_tokens"),
    ({"best_of": 3}, "sampling.best_of"),
])
def test_bad_values_are_refused_naming_the_field(sampling, field):
    msg = request(**sampling)
    with pytest.raises(RequestError) as info:
        prepare("token_ids", [1, 2, 3], protos.sampling_of(msg), None, LIMITS)
    assert info.value.field == field


def test_truncate_prompt_tokens_applies_to_a_grpc_prompt():
    msg = request(truncate_prompt_tokens=2)
    kind, value = protos.prompt_of(msg)
    prep = prepare(kind, value, protos.sampling_of(msg), None, LIMITS)
    assert prep.prompt_token_ids == [2, 3]


@pytest.mark.parametrize("so, expected", [
    (pb.StructuredOutputs(json='{"type": "object"}'), {"json": {"type": "object"}}),
    (pb.StructuredOutputs(regex="[0-9]+"), {"regex": "[0-9]+"}),
    (pb.StructuredOutputs(choice=pb.StructuredOutputs.Choice(options=["yes", "no"])),
     {"choice": ("yes", "no")}),
    (pb.StructuredOutputs(grammar='start: "a"'), {"grammar": 'start: "a"'}),
    (pb.StructuredOutputs(json_object=True), {"json_object": True}),
])
def test_structured_outputs_reach_sampling_params(so, expected):
    params = SamplingParams(**protos.sampling_of(request(structured_outputs=so)))
    (kind, value), = expected.items()
    assert params.structured_outputs.kind == kind
    assert getattr(params.structured_outputs, kind) == value


@pytest.mark.parametrize("so, field", [
    (pb.StructuredOutputs(), "sampling.structured_outputs"),  # none of the oneof set
    (pb.StructuredOutputs(json="{not json"), "sampling.structured_outputs.json"),
    (pb.StructuredOutputs(choice=pb.StructuredOutputs.Choice()),
     "sampling.structured_outputs.choice"),
    (pb.StructuredOutputs(json_object=False), "sampling.structured_outputs"),
])
def test_bad_structured_outputs_name_the_field(so, field):
    with pytest.raises(RequestError) as info:
        msg = request(structured_outputs=so)
        prepare(*protos.prompt_of(msg), protos.sampling_of(msg), None, LIMITS)
    assert info.value.field == field
