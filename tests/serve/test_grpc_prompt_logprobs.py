"""gRPC `sampling.prompt_logprobs` on the shared server (f32 SmolLM2): the first streamed
message and a batch item's completion carry one entry per prompt token (the first empty), the
prompt's token first, equal to HF transformers' log-softmax (1e-4); max_tokens=0 scores the
prompt without generating."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from jaxpipe.protocol import jaxpipe_pb2 as pb
from jaxpipe.protocol import jaxpipe_pb2_grpc as pb_grpc

torch = pytest.importorskip("torch")
from hf_families import hf_log_softmax  # noqa: E402

TEXT = "Water boils at one hundred degrees Celsius at sea level"
K = 3


@pytest.fixture(scope="module")
def stub(grpc_server):
    with grpc.insecure_channel(grpc_server.address) as channel:
        yield pb_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def ids(hf_tokenizer):
    return hf_tokenizer.encode(TEXT, add_special_tokens=False)


@pytest.fixture(scope="module")
def want(hf_model, ids):
    return hf_log_softmax(hf_model, ids)


def assert_matches_hf(entries, ids, want) -> None:
    assert len(entries) == len(ids) and len(entries[0].entries) == 0
    for t in range(1, len(ids)):
        got = entries[t].entries
        assert got[0].token_id == ids[t] and K <= len(got) <= K + 1
        np.testing.assert_allclose([e.logprob for e in got],
                                   want[t - 1][[e.token_id for e in got]], atol=1e-4, rtol=0)


def test_generate_streams_prompt_logprobs_first(stub, ids, want):
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=K)
    responses = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                                                      sampling=sampling)))
    assert_matches_hf(responses[0].prompt_logprobs, ids, want)
    assert all(not r.prompt_logprobs for r in responses[1:])
    assert sum(len(r.token_ids) for r in responses) == 3


def test_batch_item_scores_without_generating(stub, ids, want):
    sampling = pb.SamplingParams(max_tokens=0, prompt_logprobs=K)
    [result] = list(stub.GenerateBatch(pb.BatchRequest(items=[pb.BatchItem(
        custom_id="a", text=TEXT, sampling=sampling)])))
    c = result.completion
    assert list(c.token_ids) == [] and c.finish_reason == "length"
    assert_matches_hf(c.prompt_logprobs, ids, want)
