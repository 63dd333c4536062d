"""Bad input never hurts anyone else: each bad request gets INVALID_ARGUMENT naming the field
(or an error result inside a batch), and good requests right after, or beside it, succeed.
The shared server has --max-request-bytes 65536 and --max-message-mb 1."""

from __future__ import annotations

import grpc
import pytest

from jaxpipe.protocol import jaxpipe_pb2 as pb
from jaxpipe.protocol import jaxpipe_pb2_grpc as pb_grpc

OK = pb.SamplingParams(temperature=0.0, max_tokens=3)


def sp(**kw) -> pb.SamplingParams:
    return pb.SamplingParams(**{"temperature": 0.0, "max_tokens": 3, **kw})


BAD = {  # name -> (GenerateRequest fields, the field the error must name)
    "missing prompt": ({"sampling": OK}, "prompt"),
    "empty text": ({"text": "", "sampling": OK}, "text"),
    "empty token ids": ({"token_ids": pb.TokenIds(ids=[]), "sampling": OK}, "token_ids"),
    "empty chat": ({"chat": pb.Chat(), "sampling": OK}, "chat"),
    "bad chat role": ({"chat": pb.Chat(messages=[pb.ChatMessage(role="robot", content="x")]),
                       "sampling": OK}, "chat[0].role"),
    "prompt too long": ({"text": "hello " * 300, "sampling": OK}, "text"),
    "token out of vocabulary": ({"token_ids": pb.TokenIds(ids=[1, 49152]), "sampling": OK},
                                "token_ids[1]"),
    "negative token id": ({"token_ids": pb.TokenIds(ids=[-3]), "sampling": OK}, "token_ids[0]"),
    "max_tokens 0": ({"text": "Hi", "sampling": sp(max_tokens=0)}, "sampling.max_tokens"),
    "max_tokens negative": ({"text": "Hi", "sampling": sp(max_tokens=-5)},
                            "sampling.max_tokens"),
    "max_tokens too large": ({"text": "Hi", "sampling": sp(max_tokens=10**9)},
                             "sampling.max_tokens"),
    "temperature < 0": ({"text": "Hi", "sampling": sp(temperature=-0.1)},
                        "sampling.temperature"),
    "top_p 0": ({"text": "Hi", "sampling": sp(top_p=0.0)}, "sampling.top_p"),
    "top_p > 1": ({"text": "Hi", "sampling": sp(top_p=1.01)}, "sampling.top_p"),
    "top_k < -1": ({"text": "Hi", "sampling": sp(top_k=-2)}, "sampling.top_k"),
    "presence_penalty": ({"text": "Hi", "sampling": sp(presence_penalty=-2.5)},
                         "sampling.presence_penalty"),
    "frequency_penalty": ({"text": "Hi", "sampling": sp(frequency_penalty=2.5)},
                          "sampling.frequency_penalty"),
    "repetition_penalty": ({"text": "Hi", "sampling": sp(repetition_penalty=-1.0)},
                           "sampling.repetition_penalty"),
    "n > 128": ({"text": "Hi", "sampling": sp(n=129)}, "sampling.n"),
    "logprobs > 20": ({"text": "Hi", "sampling": sp(logprobs=50)}, "sampling.logprobs"),
    "seed too large": ({"text": "Hi", "sampling": sp(seed=2**40)}, "sampling.seed"),
    "oversized request": ({"text": "x" * 70_000, "sampling": OK}, "request"),
}


@pytest.fixture(scope="module")
def stub(grpc_server):
    with grpc.insecure_channel(grpc_server.address,
                              options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        yield pb_grpc.GenerationStub(ch)


def generate(stub, request) -> list[pb.GenerateResponse]:
    return list(stub.Generate(request, timeout=120))


def assert_still_serving(stub):
    out = generate(stub, pb.GenerateRequest(text="Hello", sampling=OK))
    assert sum(len(r.token_ids) for r in out) == 3 and out[-1].finish_reason == "length"


@pytest.mark.parametrize("name", list(BAD))
def test_bad_generate_request_is_invalid_argument_naming_the_field(stub, name):
    fields, field = BAD[name]
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, pb.GenerateRequest(**fields))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field}: ") or (
        name == "oversized request" and info.value.details().startswith("request"))
    assert_still_serving(stub)


def test_unknown_field_is_refused_not_ignored(grpc_server):
    # A client built from a newer proto: field 99 (varint 5) appended to a valid request.
    data = pb.GenerateRequest(text="Hi", sampling=OK).SerializeToString() + bytes([0x98, 0x06, 5])
    with grpc.insecure_channel(grpc_server.address) as ch:
        call = ch.unary_stream("/jaxpipe.v1.Generation/Generate",
                               request_serializer=lambda b: b,
                               response_deserializer=pb.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as info:
            list(call(data, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "#99" in info.value.details() and "unknown field" in info.value.details()


def test_message_over_the_transport_limit_is_refused_and_the_server_lives_on(stub):
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, pb.GenerateRequest(text="x" * (2 << 20), sampling=OK))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_still_serving(stub)


def test_bad_items_get_errors_while_the_rest_of_the_batch_completes(stub):
    items = []
    for i, (fields, _) in enumerate(BAD.values()):
        items.append(pb.BatchItem(custom_id=f"bad-{i}", **fields))
        items.append(pb.BatchItem(custom_id=f"good-{i}", text=f"Item {i}:", sampling=OK))
    items.append(pb.BatchItem(custom_id="good-0", text="duplicate", sampling=OK))
    items.append(pb.BatchItem(text="no custom id", sampling=OK))
    results = list(stub.GenerateBatch(pb.BatchRequest(items=items), timeout=300))
    errors = [r for r in results if r.WhichOneof("result") == "error"]
    done = [r for r in results if r.WhichOneof("result") == "completion"]
    assert sorted(r.custom_id for r in done) == sorted(f"good-{i}" for i in range(len(BAD)))
    assert all(len(r.completion.token_ids) == 3 for r in done)
    by_id = {r.custom_id: r.error for r in errors}
    for i, (name, (_, field)) in enumerate(BAD.items()):
        assert by_id[f"bad-{i}"].code == "INVALID_ARGUMENT"
        assert by_id[f"bad-{i}"].field == (f"items[{2 * i}]" if name == "oversized request"
                                           else field), name
    assert by_id["good-0"].field == "custom_id" and "duplicate" in by_id["good-0"].message
    assert by_id[""].field == f"items[{len(items) - 1}].custom_id"
    assert len(results) == len(items)  # every item: exactly one result
