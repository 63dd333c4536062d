"""The llama.cpp peer (jaxpipe_peers/llamacpp.py): its continuous batching's bookkeeping against
a fake llama_decode (every request gets exactly its tokens at consecutive positions, within the
sequence and token limits), and, where llama-cpp-python is installed (this environment or the
peers'), a job through files on the bundled GGUF at a tiny size."""

from __future__ import annotations

import importlib.util
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

from jaxpipe_peers.llamacpp import Batcher, context_size
from jaxpipe_peers.protocol import Request


def _fake_run(requests, max_seqs, batch_tokens):
    """Drive a Batcher with a fake decode that checks each batch and answers token 1000 + the
    position; per request (by prompt), the positions it fed and the tokens it got."""
    batcher = Batcher(requests, max_seqs, batch_tokens)
    fed, got, live, steps = defaultdict(list), defaultdict(list), {}, 0
    while not batcher.done:
        entries = batcher.plan()
        assert 0 < len(entries) <= batch_tokens
        assert len({e.seq.seq_id for e in entries}) <= max_seqs
        assert len(batcher.running) <= max_seqs
        for e in entries:
            key = e.seq.request.prompt_token_ids
            assert live.setdefault(e.seq.seq_id, key) == key  # an id is one request's at a time
            fed[key].append((e.pos, e.token))
        chosen = [(e.seq, 1000 + e.pos) for e in entries if e.logits]
        for s in batcher.advance(chosen):
            got[s.request.prompt_token_ids] = s.generated
            del live[s.seq_id]
        steps += 1
    return fed, got, steps


@pytest.mark.parametrize("max_seqs, batch_tokens", [(1, 4), (2, 5), (3, 64), (8, 8)])
def test_every_request_gets_its_tokens_at_consecutive_positions(max_seqs, batch_tokens):
    requests = [Request(tuple(range(10 * i, 10 * i + n)), out)
                for i, (n, out) in enumerate([(7, 3), (1, 5), (12, 1), (3, 4), (5, 2)])]
    fed, got, steps = _fake_run(requests, max_seqs, batch_tokens)
    for r in requests:
        key = r.prompt_token_ids
        assert got[key] == r.output_len
        positions = [p for p, _ in fed[key]]
        # the prompt, then every output token but the last fed back
        assert positions == list(range(r.prompt_len + r.output_len - 1))
        tokens = [t for _, t in fed[key]]
        outputs = [1000 + p for p in range(r.prompt_len - 1, r.prompt_len + r.output_len - 2)]
        assert tokens == list(key) + outputs  # each output is the logits' choice at pos - 1
    if max_seqs == 1:  # one at a time: a step per output token, plus the prompt chunks
        assert steps == sum(r.output_len + -(-r.prompt_len // batch_tokens) - 1
                            for r in requests)


def test_the_batcher_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="max_seqs <= batch_tokens"):
        Batcher([Request((1,), 1)], 8, 4)
    with pytest.raises(ValueError, match="samples=1"):
        Batcher([Request((1,), 1, samples=2)], 2, 4)


def test_context_has_a_stream_of_the_longest_request_per_sequence():
    work = [Request((1,) * 100, 50), Request((1,) * 10, 10), Request((1,) * 300, 100)]
    assert context_size(work, 1) == 512  # 400 -> 2 x 256
    assert context_size(work, 8) == 8 * 512
    assert context_size([Request((1,) * 200, 56)], 3) == 3 * 256


def _llama_python() -> Path:
    """A Python with llama_cpp: this one, else the peers' environment's; skip otherwise."""
    import sys

    if importlib.util.find_spec("llama_cpp") is not None:
        return Path(sys.executable)
    from jaxpipe_bench.peers import env_dir

    python = env_dir() / "bin" / "python"
    if python.is_file() and subprocess.run([str(python), "-c", "import llama_cpp"],
                                           capture_output=True).returncode == 0:
        return python
    pytest.skip(f"llama-cpp-python is installed neither here nor in the peers' environment "
                f"({env_dir()}): `make bench-env` builds it from source")


def test_llamacpp_peer_runs_a_job_through_files(gguf_path):
    from jaxpipe_bench.peers import run_peer
    from jaxpipe_peers.protocol import requests_to_json

    python = _llama_python()
    requests = [Request((5, 6, 7), 3), Request((8, 9), 5), Request((10, 11, 12, 13), 2)]
    job = {"peer": "llamacpp", "model": str(gguf_path), "requests": requests_to_json(requests),
           "warmup": requests_to_json(requests[:1]), "threads": [1], "max_seqs": [2, 3],
           "batch_tokens": 4}
    result = run_peer(job, lambda _: None, python)
    points = result["points"]
    assert [(p["threads"], p["batch_size"]) for p in points] == [(1, 2), (1, 3)]
    assert all(p["num_requests"] == 3 and p["output_tokens"] == 10 for p in points)
    assert all(p["dtype"] == "Q4_1" and p["engine"] == "llamacpp" for p in points)
    assert result["best"] in points
    assert result["versions"]["llama-cpp-python"]
