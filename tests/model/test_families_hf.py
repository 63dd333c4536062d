"""The families beside Llama (Qwen2/2.5, Qwen3, Mistral, Gemma 2/3) and HF's RoPE scaling
types, each against HF transformers on the same tiny checkpoint of seeded random weights
written by transformers itself (every parameter drawn, biases and norms included): prompt
logits of the cache-free forward, and greedy tokens (f32) through the engine's paged step."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe import Engine, EngineConfig, SamplingParams
from jaxpipe.model import loading
from jaxpipe.model.decoder import Decoder
from jaxpipe.model.presets import resolve_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 256
NEW_TOKENS = 12
LOGITS_ATOL = 1e-4
WINDOW = 20  # past one 16-token block: windows begin inside blocks; prompts run past it
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)

# name -> (config class, its fields beyond SMALL): every switch at least once.
FAMILIES = {
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),  # q/k/v biases, tied head
    "qwen2_window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW,
                                         max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(head_dim=24)),  # q/k norms, head_dim != hidden / heads
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW, head_dim=16)),
    # (1 + w) norms, four per layer, sqrt(E) embeddings, GELU-tanh, its own q.k scale, both
    # soft-caps low enough to bite, windows on every other layer.
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=WINDOW, tie_word_embeddings=True,
                                    query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                                    final_logit_softcapping=15.0)),
    # Gemma 2's plus q/k norms (1 + w), each layer type its own RoPE: linear scaling on the
    # global layer, another base on the sliding ones.
    "gemma3": ("Gemma3TextConfig", dict(
        head_dim=16, sliding_window=WINDOW, tie_word_embeddings=True, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})),
    "llama_linear": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama_dynamic": ("LlamaConfig", dict(rope_scaling={"rope_type": "dynamic",
                                                        "factor": 2.0})),
    "llama_yarn": ("LlamaConfig", dict(rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})),
    "llama3": ("LlamaConfig", dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
}
PROMPTS = [[5, 17, 200, 3, 99, 42, 7], list(range(30, 90)), [1, 2],
           [int(t) for t in np.random.default_rng(0).integers(0, VOCAB, 100)]]


def _draw_every_parameter(model, seed: int) -> None:
    """Matrices N(0, 1/fan_in), embeddings N(0, 1), norms 1 + N(0, 0.1), biases N(0, 0.1):
    nothing left at its HF initial value (a bias of 0 or a norm of 1 would hide a dropped
    parameter)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("bias"):
                p.copy_(0.1 * z)
            elif p.ndim == 1:
                p.copy_(1.0 + 0.1 * z)
            elif "embed" in name:
                p.copy_(z)
            else:
                p.copy_(z / p.shape[1] ** 0.5)


def _write(name: str, tmp_path_factory):
    """(HF model in f32, its checkpoint directory) of family `name`."""
    cls, extra = FAMILIES[name]
    config = getattr(transformers, cls)(**{**SMALL, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    _draw_every_parameter(model, seed=sorted(FAMILIES).index(name))
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path, safe_serialization=True)
    return model, path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, HF model in f32, checkpoint directory)."""
    return request.param, *_write(request.param, tmp_path_factory)


def _hf_greedy(model, ids: list[int]) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_config_reads_the_family_switches(family):
    name, _, path = family
    cfg = loading.hf_config(__import__("json").loads((path / "config.json").read_text()))
    assert cfg.qkv_bias == name.startswith("qwen2")
    assert cfg.qk_norm == (name in ("qwen3", "gemma3"))
    assert cfg.head_dim == {"qwen3": 24}.get(name, 16)
    windows = {"qwen2_window": (WINDOW, (1, 2)), "mistral": (WINDOW, (0, 1, 2)),
               "gemma2": (WINDOW, (0, 2)), "gemma3": (WINDOW, (0, 2))}
    assert (cfg.sliding_window, cfg.sliding_layers) == windows.get(name, (None, ()))
    gemma = name.startswith("gemma")
    assert (cfg.sandwich_norms, cfg.mlp_act) == (gemma, "gelu_tanh" if gemma else "silu")
    caps = {"gemma2": (3.0, 15.0)}.get(name, (None, None))
    assert (cfg.attn_scale, cfg.attn_softcap, cfg.final_softcap) == (
        (24 ** -0.5 if gemma else None), *caps)
    assert cfg.embed_scale == (64 ** 0.5 if gemma else 1.0)
    assert cfg.rope_local_theta == (500.0 if name == "gemma3" else None)
    kind = None if cfg.rope_scaling is None else cfg.rope_scaling.rope_type
    assert kind == {"llama_linear": "linear", "llama_dynamic": "dynamic", "llama_yarn": "yarn",
                    "llama3": "llama3", "gemma3": "linear"}.get(name)


def test_forward_logits_match_hf(family):
    _, hf_model, path = family
    cfg, values = loading.load_hf_dir(path)
    model = Decoder(cfg, dtype=jnp.float32, values=values)
    for ids in PROMPTS:
        with torch.no_grad():
            want = hf_model(torch.tensor([ids])).logits[0].float().numpy()
        got = np.asarray(model.forward(jnp.asarray([ids])))[0]
        np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("attention", ["auto", "xla"])
def test_engine_greedy_tokens_match_hf(family, attention):
    """The engine's step (paged KV, chunked prefill: a 32-token budget splits the long
    prompts, whose chunks straddle the sliding windows' edges) on the default attention (the
    C++ kernel here) and, for the families whose attention differs (windows, soft-caps,
    scale), XLA's."""
    name, hf_model, path = family
    if attention == "xla" and name not in ("mistral", "qwen2_window", "gemma2", "gemma3"):
        pytest.skip("XLA's attention runs the same as Llama's for this family")
    engine = Engine(EngineConfig(model=str(path), dtype="float32", max_model_len=128,
                                 max_num_seqs=4, max_num_batched_tokens=32, warmup=False,
                                 show_progress=False, attention=attention))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    for ids, out in zip(PROMPTS, outs, strict=True):
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf_model, ids)


def test_resolves_as_hf(family):
    assert resolve_model(str(family[2])).kind == "hf"


@pytest.mark.parametrize("change, match", [
    ({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"},
     r"architectures=\['Phi3ForCausalLM'\].*supported: \['Gemma2ForCausalLM'"),
    ({"hidden_act": "relu"}, r"hidden_act='relu' is not supported; supported: "
                             r"\['gelu_pytorch_tanh', 'silu'\]"),
    ({"attention_bias": True}, r"attention_bias=true is not supported for llama"),
    ({"mlp_bias": True}, r"mlp_bias=true"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
     r"rope_scaling type 'longrope' is not supported; supported: default, llama3"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 2.0}},
     r"rope_scaling of type 'llama3' lacks 'low_freq_factor'"),
    ({"layer_types": ["full_attention", "chunked_attention", "full_attention"],
      "architectures": ["MistralForCausalLM"]}, r"layer_types \['chunked_attention'\]"),
])
def test_unsupported_config_values_fail_naming_the_field(change, match):
    config = {**SMALL, "architectures": ["LlamaForCausalLM"], "model_type": "llama", **change}
    with pytest.raises(ValueError, match=match):
        loading.hf_config(config)
