"""The perplexity harness (jaxpipe_bench/perplexity.py): windows that score every token of the
text but its first exactly once, the configurations --dtype and --engine-field spell, and the
engine's perplexity over the shipped text's first 1,000 tokens against HF transformers'
float32 log-softmax on the same windows (within 1e-3 relative)."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from jaxpipe_bench import perplexity as ppl

NUM_TOKENS = 1000
RTOL = 1e-3


@pytest.mark.parametrize("num_tokens, length, stride",
                         [(1000, 255, 127), (1000, 255, 254), (7, 4, 1), (10, 20, 5),
                          (256, 255, 127), (2, 2, 1)])
def test_windows_score_every_token_but_the_first_once(num_tokens, length, stride):
    wins = ppl.windows(num_tokens, length, stride)
    scored = [t for w in wins for t in range(w.scored_from, w.stop)]
    assert scored == list(range(1, num_tokens))  # each once, in order; token 0 predicts only
    assert all(w.stop - w.start <= length for w in wins)
    assert [w.start for w in wins] == [i * stride for i in range(len(wins))]
    # every window after the first sees length - stride tokens of context before its first score
    assert all(w.scored_from - w.start == length - stride for w in wins[1:])
    assert wins[-1].stop == num_tokens


def test_windows_must_overlap():
    with pytest.raises(ValueError, match="stride must be in"):
        ppl.windows(100, 10, 10)
    with pytest.raises(ValueError, match="stride must be in"):
        ppl.windows(100, 10, 0)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        ppl.windows(1, 10, 5)


def test_configurations_cross_dtypes_with_engine_fields():
    configs = ppl.engine_configs(("bfloat16", "float32"),
                                 ["max-num-seqs=4,8", "overlap=false", "kv_cache_gb=none"])
    assert configs == [
        {"dtype": "bfloat16", "max_num_seqs": 4, "overlap": False, "kv_cache_gb": None},
        {"dtype": "bfloat16", "max_num_seqs": 8, "overlap": False, "kv_cache_gb": None},
        {"dtype": "float32", "max_num_seqs": 4, "overlap": False, "kv_cache_gb": None},
        {"dtype": "float32", "max_num_seqs": 8, "overlap": False, "kv_cache_gb": None}]
    assert ppl.engine_configs(("float32",), ["attention=xla"]) == [
        {"dtype": "float32", "attention": "xla"}]


def test_bad_engine_fields_are_named():
    with pytest.raises(ValueError, match="EngineConfig has no field 'quantisation'"):
        ppl.engine_configs(("float32",), ["quantisation=int8"])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        ppl.engine_configs(("float32",), ["max_num_seqs"])


def test_the_command_line_repeats_engine_fields():
    cfg = ppl.parse("doc", ["--dtype", "float32,bfloat16", "--engine-field", "max_num_seqs=4,8",
                            "--engine-field", "overlap=false", "--max-model-len", "256"])
    assert cfg.dtypes == ("float32", "bfloat16")
    assert cfg.engine_fields == ("max_num_seqs=4,8", "overlap=false")
    assert (cfg.window_len, cfg.window_stride) == (255, 127)
    with pytest.raises(SystemExit):
        ppl.parse("doc", ["--max-model-len", "256", "--stride", "255"])
    with pytest.raises(SystemExit):
        ppl.parse("doc", ["--engine-field", "no_such_field=1"])


def test_the_shipped_text_is_long_and_unchanged(engine):
    readme = (ppl.TEXT.parent / "README.md").read_text()
    assert hashlib.sha256(ppl.TEXT.read_bytes()).hexdigest() in readme
    assert len(ppl.text_token_ids(engine.tokenizer)) >= 4000


def _hf_reference_nll(hf_model, ids, wins) -> np.ndarray:
    """Per scored token, -log softmax of HF's float32 logits at the position before it."""
    torch = pytest.importorskip("torch")
    out = []
    with torch.inference_mode():
        for w in wins:
            window = ids[w.start:w.stop]
            logits = hf_model(input_ids=torch.tensor([window])).logits[0].double().numpy()
            top = logits.max(-1, keepdims=True)
            logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
            out += [-logp[t - w.start - 1, ids[t]] for t in range(w.scored_from, w.stop)]
    return np.array(out)


def test_engine_perplexity_matches_hf(engine, hf_model):
    ids = ppl.text_token_ids(engine.tokenizer, NUM_TOKENS)
    wins = ppl.windows(len(ids), engine.max_model_len - 1, (engine.max_model_len - 1) // 2)
    assert len(wins) > 1  # the overlap is exercised
    want = _hf_reference_nll(hf_model, ids, wins)
    got = ppl.engine_nll(engine, ids, wins)
    assert got.shape == want.shape == (NUM_TOKENS - 1,)
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)
    engine_ppl, hf_ppl = ppl.summary(got)["perplexity"], math.exp(want.mean())
    assert abs(engine_ppl / hf_ppl - 1) < RTOL, (engine_ppl, hf_ppl)
    assert 5 < hf_ppl < 100  # an English text a trained model reads: not noise, not memorised
    # the script's own HF path scores the same windows the same way
    np.testing.assert_allclose(ppl.hf_nll(hf_model, ids, wins), want, atol=1e-6, rtol=0)
