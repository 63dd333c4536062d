"""Tests for the benchmark workload, FLOP count and report helpers (no engine, no torch)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from jaxpipe_bench.matmul import model_flops
from jaxpipe_bench.report import format_table, throughput
from jaxpipe_bench.workload import (
    OUTPUT_LEN_BOUNDS,
    PROMPT_LEN_BOUNDS,
    Request,
    describe_workload,
    make_workload,
    parse_shared_prefix,
    share_prefixes,
)

VOCAB = 49152
SPECIAL = tuple(range(17))  # SmolLM2's control tokens
SMOLLM2 = SimpleNamespace(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    tie_embeddings=True,
)


def test_same_seed_same_workload():
    assert make_workload(32, 7, VOCAB, special_ids=SPECIAL) == make_workload(
        32, 7, VOCAB, special_ids=SPECIAL
    )


def test_different_seed_different_workload():
    a = make_workload(32, 0, VOCAB, special_ids=SPECIAL)
    b = make_workload(32, 1, VOCAB, special_ids=SPECIAL)
    assert [r.prompt_len for r in a] != [r.prompt_len for r in b]
    assert a[0].prompt_token_ids != b[0].prompt_token_ids


def test_lengths_within_clip_bounds():
    workload = make_workload(2000, 3, VOCAB)
    prompt = [r.prompt_len for r in workload]
    output = [r.output_len for r in workload]
    assert PROMPT_LEN_BOUNDS[0] <= min(prompt) and max(prompt) <= PROMPT_LEN_BOUNDS[1]
    assert OUTPUT_LEN_BOUNDS[0] <= min(output) and max(output) <= OUTPUT_LEN_BOUNDS[1]
    # ShareGPT-like: medians near the documented choices, and a heavy tail reaching the clip.
    stats = describe_workload(workload)
    assert 150 <= stats["prompt_len"]["median"] <= 250
    assert 110 <= stats["output_len"]["median"] <= 190
    assert max(prompt) == PROMPT_LEN_BOUNDS[1] and max(output) == OUTPUT_LEN_BOUNDS[1]


def test_fixed_lengths_honoured():
    workload = make_workload(10, 0, VOCAB, input_len=37, output_len=5)
    assert all(r.prompt_len == 37 and r.output_len == 5 for r in workload)
    # Fixing one length leaves the other lognormal.
    mixed = make_workload(50, 0, VOCAB, output_len=64)
    assert {r.output_len for r in mixed} == {64}
    assert len({r.prompt_len for r in mixed}) > 1


def test_no_special_ids_and_ids_in_vocab():
    special = SPECIAL + (VOCAB - 1,)
    workload = make_workload(200, 5, VOCAB, special_ids=special)
    seen = {t for r in workload for t in r.prompt_token_ids}
    assert not seen & set(special)
    assert min(seen) >= 0 and max(seen) < VOCAB


def test_tiny_vocab_excludes_specials_exactly():
    workload = make_workload(20, 0, 4, input_len=50, output_len=1, special_ids=(0, 2))
    assert {t for r in workload for t in r.prompt_token_ids} == {1, 3}


def test_request_is_frozen_and_hashable():
    req = make_workload(1, 0, VOCAB)[0]
    assert isinstance(req.prompt_token_ids, tuple)
    assert all(type(t) is int for t in req.prompt_token_ids)
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.output_len = 3  # type: ignore[misc]
    hash(req)


def test_invalid_arguments():
    with pytest.raises(ValueError):
        make_workload(0, 0, VOCAB)
    with pytest.raises(ValueError):
        make_workload(4, 0, VOCAB, input_len=0)
    with pytest.raises(ValueError):
        make_workload(4, 0, 3, special_ids=(0, 1, 2))


def test_shared_prefix_workload():
    """Each request is one of N prefixes (lengths in range, tokens not special) + the usual
    workload's prompt; the prefixes serve even shares in a shuffled order; seeded."""
    base = make_workload(40, 2, VOCAB, special_ids=SPECIAL)
    shared, prefixes = share_prefixes(base, 5, (50, 90), 2, VOCAB, SPECIAL)
    assert len(prefixes) == 5 and all(50 <= len(p) <= 90 for p in prefixes)
    assert len({len(p) for p in prefixes}) > 1 and not {t for p in prefixes for t in p} & \
        set(SPECIAL)
    which = []
    for req, own in zip(shared, base, strict=True):
        [k] = [k for k, p in enumerate(prefixes) if req.prompt_token_ids[:len(p)] == p]
        assert req.prompt_token_ids == prefixes[k] + own.prompt_token_ids
        assert req.output_len == own.output_len
        which.append(k)
    assert sorted(which) == sorted(i % 5 for i in range(40))  # 8 requests each
    assert which != sorted(which) and which != [i % 5 for i in range(40)]  # shuffled
    assert share_prefixes(base, 5, (50, 90), 2, VOCAB, SPECIAL) == (shared, prefixes)
    other, _ = share_prefixes(base, 5, (50, 90), 3, VOCAB, SPECIAL)
    assert other != shared
    fixed = share_prefixes(base, 1, (64, 64), 2, VOCAB)[1]
    assert [len(p) for p in fixed] == [64]


def test_shared_prefix_flag_is_parsed_and_checked():
    assert parse_shared_prefix("5:500-1100") == (5, 500, 1100)
    assert parse_shared_prefix("2:300") == (2, 300, 300)
    for bad in ("5", "0:100", "5:900-500", "a:1-2", "5:0", "5:-3"):
        with pytest.raises(ValueError, match=f"N:LO-HI .*got '{bad}'"):
            parse_shared_prefix(bad)


def test_model_flops_matches_hand_count():
    cfg = SMOLLM2
    per_layer = 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536
    body, head = 2 * 30 * per_layer, 2 * 576 * 49152
    attn = 4 * 30 * 9 * 64
    # P=3, O=2: 4 forwarded tokens attending 1+2+3+4 keys; LM head on the 2 generated tokens.
    expected = 4 * body + 2 * head + attn * 10
    assert model_flops(cfg, [3], [2]) == pytest.approx(expected)
    assert model_flops(cfg, [3, 3], [2, 2]) == pytest.approx(2 * expected)
    # ~2 * 135M FLOPs per token for the 135M-parameter model.
    assert model_flops(cfg, [1], [2]) / 2 == pytest.approx(2 * 134.5e6, rel=0.01)


def test_throughput_counts_own_output_len_only():
    reqs = [Request((1, 2, 3), 10), Request((4,), 30)]
    t = throughput(reqs, 2.0)
    assert t["requests_per_s"] == 1.0
    assert t["output_tok_s"] == 20.0
    assert t["total_tok_s"] == 22.0
    table = format_table([t | {"engine": "x", "dtype": "bfloat16", "batch_size": 4}])
    assert "20.0" in table and "bfloat16" in table


class _FakeEngine:
    """Stands in for jaxpipe.Engine: echoes prompts, returns `max_tokens` tokens (or fewer)."""

    short_by = 0
    closed = 0  # engines closed (each run closes its own before the next is built)

    def __init__(self, config):
        self.config = config
        self.model_config = SMOLLM2
        self.max_num_seqs = getattr(config, "max_num_seqs", None)

    def generate(self, prompt_token_ids, sampling_params, use_tqdm=True):
        def out(prompt, params):
            tokens = [5] * (params.max_tokens - self.short_by)
            return SimpleNamespace(
                prompt_token_ids=prompt, outputs=[SimpleNamespace(token_ids=tokens)]
            )

        return [out(p, s) for p, s in zip(prompt_token_ids, sampling_params, strict=True)]

    def stats(self):
        return {"steps": 1}

    def close(self):
        type(self).closed += 1


@pytest.fixture
def fake_engine(monkeypatch):
    import jaxpipe

    monkeypatch.setattr(jaxpipe, "Engine", _FakeEngine, raising=False)
    monkeypatch.setattr(jaxpipe, "EngineConfig", SimpleNamespace, raising=False)
    monkeypatch.setattr(jaxpipe, "SamplingParams", SimpleNamespace, raising=False)
    _FakeEngine.short_by = _FakeEngine.closed = 0
    return _FakeEngine


def test_run_jaxpipe_with_fake_engine(fake_engine):
    from jaxpipe_bench import BenchConfig, run_jaxpipe

    workload = make_workload(6, 0, VOCAB, input_len=100, output_len=20)
    result, model_config = run_jaxpipe(BenchConfig(max_num_seqs=4), workload, log=lambda _: None)
    assert result["num_requests"] == 6 and result["output_tokens"] == 120
    assert result["engine_config"]["max_model_len"] == 128  # 120 rounded up to 128
    assert result["batch_size"] == 4 and result["engine_stats"] == {"steps": 1}
    assert result["process_cpu_s"] >= result["engine_thread_cpu_s"] >= 0  # every thread's >= one's
    assert model_config is SMOLLM2 and _FakeEngine.closed == 1


def test_run_jaxpipe_rejects_short_outputs(fake_engine):
    from jaxpipe_bench import BenchConfig, run_jaxpipe

    fake_engine.short_by = 1
    workload = make_workload(3, 0, VOCAB, input_len=10, output_len=5)
    with pytest.raises(RuntimeError, match=r"got \[4\] output tokens, expected 1 x 5"):
        run_jaxpipe(BenchConfig(warmup_prompts=0), workload, log=lambda _: None)
    assert fake_engine.closed == 1  # closed on the way out too


def test_check_outputs_detects_reordering():
    from jaxpipe_bench import check_outputs

    workload = make_workload(2, 0, VOCAB, input_len=4, output_len=2)
    outs = [
        SimpleNamespace(
            prompt_token_ids=list(r.prompt_token_ids), outputs=[SimpleNamespace(token_ids=[1, 2])]
        )
        for r in reversed(workload)
    ]
    with pytest.raises(RuntimeError, match="different prompt"):
        check_outputs(outs, workload)
    with pytest.raises(RuntimeError, match="returned 1 outputs"):
        check_outputs(outs[:1], workload)


def test_warmup_requests_share_no_prefix():
    from jaxpipe_bench import warmup_requests

    workload = make_workload(4, 0, VOCAB, input_len=64)
    warm = warmup_requests(workload, 2, max_output=16)
    assert len(warm) == 2 and all(w.output_len <= 16 for w in warm)
    assert all(
        w.prompt_token_ids[:16] != r.prompt_token_ids[:16]
        for w, r in zip(warm, workload[:2], strict=True)
    )


def test_a_rollout_workload_draws_prompt_lengths_in_its_range_and_asks_for_samples():
    workload = make_workload(64, 0, VOCAB, output_len=256, input_range=(256, 1024), samples=8)
    lens = [r.prompt_len for r in workload]
    assert min(lens) >= 256 and max(lens) <= 1024 and len(set(lens)) > 32
    assert {r.samples for r in workload} == {8}
    with pytest.raises(ValueError, match="input_range"):
        make_workload(2, 0, VOCAB, input_range=(9, 8))
    with pytest.raises(ValueError, match="samples"):
        make_workload(2, 0, VOCAB, samples=0)


def test_throughput_counts_each_sample_and_each_prompt_once():
    t = throughput([Request((1, 2, 3), 10, samples=4), Request((4,), 30)], 2.0)
    assert t["output_tokens"] == 70 and t["prompt_tokens"] == 4


def test_the_rollout_flags_are_parsed_and_checked():
    from jaxpipe_bench import BenchConfig

    assert BenchConfig(input_range="256-1024", samples=8).prompt_range == (256, 1024)
    for bad in ("1024-256", "0-5", "x-9", "12"):
        with pytest.raises(ValueError, match="input_range"):
            BenchConfig(input_range=bad)
    with pytest.raises(ValueError, match="not both"):
        BenchConfig(input_range="1-2", input_len=4)
    with pytest.raises(ValueError, match="samples"):
        BenchConfig(samples=0)


def test_a_rollout_asks_the_engine_for_n_seeded_samples_and_checks_them(fake_engine):
    from jaxpipe_bench import check_outputs, run_jaxpipe

    asked = []

    def generate(self, prompt_token_ids, sampling_params, use_tqdm=True):
        asked.extend(sampling_params)
        return [SimpleNamespace(prompt_token_ids=p, outputs=[
            SimpleNamespace(token_ids=[5] * s.max_tokens) for _ in range(s.n)])
            for p, s in zip(prompt_token_ids, sampling_params, strict=True)]

    fake_engine.generate = generate
    from jaxpipe_bench import BenchConfig

    workload = make_workload(3, 0, VOCAB, input_len=10, output_len=5, samples=4)
    result, _ = run_jaxpipe(BenchConfig(warmup_prompts=0), workload, log=lambda _: None)
    assert result["output_tokens"] == 3 * 4 * 5
    assert [(s.n, s.temperature, s.seed) for s in asked] == [(4, 1.0, i) for i in range(3)]
    one_short = [SimpleNamespace(prompt_token_ids=list(r.prompt_token_ids), outputs=[
        SimpleNamespace(token_ids=[5] * 5)] * 3) for r in workload]
    with pytest.raises(RuntimeError, match="expected 4 x 5"):
        check_outputs(one_short, workload)
