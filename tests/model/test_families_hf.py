"""The families beside Llama (Qwen2/2.5, Qwen3, Mistral, Gemma 2/3) and HF's RoPE scaling
types, each against HF transformers on the same tiny checkpoint of seeded random weights
written by transformers itself (`hf_families`: every parameter drawn, biases and norms
included): prompt logits of the cache-free forward, and greedy tokens (f32) through the
engine's paged step. The layouts: tests/multidevice/test_families_layouts.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_families  # noqa: E402
from hf_families import (  # noqa: E402
    FAMILIES,
    NEW_TOKENS,
    PROMPTS,
    WINDOW,
    WINDOWED,
    assert_forward_matches_hf,
    hf_greedy,
    write,
)

from jaxpipe import Engine, EngineConfig, SamplingParams  # noqa: E402
from jaxpipe.model import hf_dir, orbax_dir  # noqa: E402
from jaxpipe.model.presets import resolve_model  # noqa: E402
from jaxpipe.runtime import step_inputs  # noqa: E402
from jaxpipe.runtime.step_inputs import Piece  # noqa: E402

LOGITS_ATOL = 1e-4
FAST = dict(dtype="float32", max_model_len=160, warmup=False, show_progress=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


checkpoints = hf_families.checkpoint_fixture(write)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, checkpoints):
    return checkpoints(request.param)


@pytest.fixture(scope="module")
def hf_tokens():
    """family -> HF's greedy tokens of every prompt, generated once per family."""
    made = {}

    def get(family) -> list[list[int]]:
        name, model, _ = family
        if name not in made:
            made[name] = [hf_greedy(model, ids) for ids in PROMPTS]
        return made[name]

    return get


@pytest.fixture(scope="module")
def one_row_engine(checkpoints):
    """name -> a one-row engine on that family's checkpoint, built once (runner-level tests
    write their prompt's KV before they read it, so a used pool does)."""
    made = {}

    def get(name) -> Engine:
        if name not in made:
            made[name] = Engine(EngineConfig(model=str(checkpoints(name)[2]), max_num_seqs=1,
                                             **FAST))
        return made[name]

    yield get
    for engine in made.values():
        engine.close()


def test_config_reads_the_family_switches(family):
    name, _, path = family
    cfg = hf_dir.hf_config(json.loads((path / "config.json").read_text()))
    assert cfg.qkv_bias == name.startswith("qwen2")
    assert cfg.qk_norm == (name in ("qwen3", "gemma3"))
    assert cfg.head_dim == {"qwen3": 24}.get(name, 16) and cfg.num_heads == 6
    assert cfg.rotary_dim == (12 if name.startswith("phi3") else None)
    windows = {"qwen2_window": (WINDOW, (1, 2)), "mistral": (WINDOW, (0, 1, 2)),
               "gemma2": (WINDOW, (0, 2)), "gemma3": (WINDOW, (0, 2)), "phi3": (WINDOW, (0, 1, 2))}
    assert (cfg.sliding_window, cfg.sliding_layers) == windows.get(name, (None, ()))
    gemma = name.startswith("gemma")
    assert (cfg.sandwich_norms, cfg.mlp_act) == (gemma, "gelu_tanh" if gemma else "silu")
    caps = {"gemma2": (3.0, 15.0)}.get(name, (None, None))
    assert (cfg.attn_scale, cfg.attn_softcap, cfg.final_softcap) == (
        (24 ** -0.5 if gemma else None), *caps)
    assert cfg.embed_scale == (66 ** 0.5 if gemma else 1.0)
    assert cfg.rope_local_theta == (500.0 if name == "gemma3" else None)
    kind = None if cfg.rope_scaling is None else cfg.rope_scaling.rope_type
    assert kind == {"llama_linear": "linear", "llama_dynamic": "dynamic", "llama_yarn": "yarn",
                    "llama3": "llama3", "gemma3": "linear", "phi3_longrope": "longrope"}.get(name)


def test_forward_logits_match_hf(family):
    _, hf_model, path = family
    assert_forward_matches_hf(hf_model, *hf_dir.load_hf_dir(path), atol=LOGITS_ATOL)


@pytest.mark.parametrize("name, attention", [(n, "auto") for n in sorted(FAMILIES)]
                         + [(n, "xla") for n in WINDOWED])
def test_engine_greedy_tokens_match_hf(checkpoints, hf_tokens, name, attention):
    """The engine's step (paged KV, chunked prefill: a 32-token budget splits the long
    prompts, whose chunks straddle the sliding windows' edges, mixed with decode tokens) on
    the default attention (the C++ kernel here) and, for the families whose attention differs
    (windows, soft-caps, scale), XLA's."""
    family = checkpoints(name)
    engine = Engine(EngineConfig(model=str(family[2]), max_num_seqs=4, max_num_batched_tokens=32,
                                 attention=attention, **FAST))
    outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_tokens(family)
    stats = engine.stats()  # the budget split the long prompts, and no step passed it
    assert stats["max_step_tokens"] <= 32 and stats["decode_tokens"] > 0
    assert stats["prefill_chunks"] >= sum(-(-len(p) // 32) for p in PROMPTS) > len(PROMPTS)


@pytest.mark.parametrize("chunk", [1, 7, 100])
@pytest.mark.parametrize("name", WINDOWED)
def test_windowed_families_chunked_prefill_logits_match_hf(checkpoints, one_row_engine, name,
                                                          chunk):
    """A 100-token prompt (five windows) prefilled in chunks of 1, 7 or whole through the
    engine's step on the C++ kernel: each chunk's last logits equal HF's at that position,
    as windows cross chunk and block edges at every offset."""
    hf_model = checkpoints(name)[1]
    engine = one_row_engine(name)
    runner, ids = engine.runner, PROMPTS[3]
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0].float().numpy()
    blocks = list(range(runner.max_blocks))  # a fresh pool: any blocks do
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        tokens = engine.buckets.tokens(len(part))
        inputs = step_inputs.build([Piece(part, start, blocks)], tokens,
                                   engine.buckets.rows(tokens),
                                   runner.max_blocks)
        got = np.asarray(runner.logits(inputs, 1))[0]
        np.testing.assert_allclose(got, want[start + len(part) - 1], rtol=0, atol=LOGITS_ATOL,
                                   err_msg=f"chunk of {len(part)} at {start}")


def test_longrope_past_its_original_length_is_refused_naming_it(checkpoints):
    path = checkpoints("phi3_longrope")[2]
    with pytest.raises(ValueError, match=r"max_model_len=300 exceeds the model's rope_scaling\."
                                         r"original_max_position_embeddings=256 \(LongRoPE"):
        Engine(EngineConfig(model=str(path), **{**FAST, "max_model_len": 300}))


@pytest.mark.parametrize("name", ["gemma3", "phi3_longrope", "qwen2_window"])
def test_orbax_conversion_keeps_every_switch(checkpoints, hf_tokens, name, tmp_path):
    """scripts/convert.py's path (save_orbax of the HF directory's weights): the orbax
    checkpoint's engine gives HF's tokens, its architecture (windows, per-layer RoPE,
    LongRoPE factors) read back equal."""
    family = checkpoints(name)
    cfg, values = hf_dir.load_hf_dir(family[2])
    orbax_dir.save_orbax(tmp_path / "ckpt", cfg, values, "float32")
    assert orbax_dir.orbax_config(tmp_path / "ckpt") == cfg
    engine = Engine(EngineConfig(model=str(tmp_path / "ckpt"), max_num_seqs=4, **FAST))
    outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_tokens(family)


def test_resolves_as_hf(family):
    assert resolve_model(str(family[2])).kind == "hf"


@pytest.mark.parametrize("change, match", [
    ({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"},
     r"architectures=\['GPTNeoXForCausalLM'\].*supported: \['Gemma2ForCausalLM'"),
    ({"hidden_act": "relu"}, r"hidden_act='relu' is not supported; supported: "
                             r"\['gelu_pytorch_tanh', 'silu'\]"),
    ({"attention_bias": True}, r"attention_bias=true is not supported for llama"),
    ({"mlp_bias": True}, r"mlp_bias=true"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
     r"rope_scaling of type 'longrope' lacks 'short_factor'"),
    ({"rope_scaling": {"rope_type": "su", "factor": 2.0}},
     r"rope_scaling type 'su' is not supported; supported: default, llama3"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 2.0}},
     r"rope_scaling of type 'llama3' lacks 'low_freq_factor'"),
    ({"layer_types": ["full_attention", "chunked_attention", "full_attention"],
      "architectures": ["MistralForCausalLM"]}, r"layer_types \['chunked_attention'\]"),
])
def test_unsupported_config_values_fail_naming_the_field(change, match):
    config = {**hf_families.SMALL, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
              **change}
    with pytest.raises(ValueError, match=match):
        hf_dir.hf_config(config)
