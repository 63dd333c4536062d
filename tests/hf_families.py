"""Tiny checkpoints of the model families, written by transformers with every parameter drawn,
and HF's greedy continuation: the independent reference of tests/model/test_families_hf.py and
tests/multidevice/test_families_layouts.py. The fixtures and the layout check those files and
tests/model/test_moe_hf.py, tests/multidevice/test_moe_layouts.py (`hf_moe`) share."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

VOCAB = 251
NEW_TOKENS = 24
WINDOW = 20  # past one 16-token block: windows begin inside blocks; prompts run past it
# Prime-ish: 6 query heads in GQA groups of 3 (tp=4 divides neither), an odd MLP width.
SMALL = dict(vocab_size=VOCAB, hidden_size=66, intermediate_size=97, num_hidden_layers=3,
             num_attention_heads=6, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
             tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)

# name -> (config class, its fields beyond SMALL): every switch at least once.
FAMILIES = {
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),  # q/k/v biases, tied head
    "qwen2_window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW,
                                         max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(head_dim=24)),  # q/k norms, head_dim != hidden / heads
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    # (1 + w) norms, four per layer, sqrt(E) embeddings, GELU-tanh, its own q.k scale, both
    # soft-caps low enough to bite, windows on every other layer.
    "gemma2": ("Gemma2Config", dict(sliding_window=WINDOW, tie_word_embeddings=True,
                                    query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                                    final_logit_softcapping=15.0)),
    # Gemma 2's plus q/k norms (1 + w), each layer type its own RoPE: linear scaling on the
    # global layer, another base on the sliding ones.
    "gemma3": ("Gemma3TextConfig", dict(
        sliding_window=WINDOW, tie_word_embeddings=True, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})),
    # Fused qkv_proj and gate_up_proj, RoPE on 12 of 16 dimensions, a window on every layer.
    "phi3": ("Phi3Config", dict(hidden_size=96, partial_rotary_factor=0.75,
                                sliding_window=WINDOW)),
    # LongRoPE: per-frequency short factors and cos/sin scaled (max positions 2x the original).
    "phi3_longrope": ("Phi3Config", dict(
        hidden_size=96, partial_rotary_factor=0.75, original_max_position_embeddings=256,
        rope_scaling={"rope_type": "longrope",
                      "short_factor": [1.0, 1.3, 1.9, 2.4, 3.1, 4.0],
                      "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 8.0]})),
    "llama_linear": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama_dynamic": ("LlamaConfig", dict(rope_scaling={"rope_type": "dynamic",
                                                        "factor": 2.0})),
    "llama_yarn": ("LlamaConfig", dict(rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})),
    "llama3": ("LlamaConfig", dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
}
WINDOWED = ("mistral", "qwen2_window", "gemma2", "gemma3", "phi3")
PROMPTS = [[5, 17, 200, 3, 99, 42, 7], list(range(30, 90)), [1, 2],
           [int(t) for t in np.random.default_rng(0).integers(0, VOCAB, 100)]]



def hf_log_softmax(model, ids: list[int]) -> np.ndarray:
    """HF's log_softmax over the vocabulary at every position of `ids`, f32 [T, V]: the
    reference of the prompt-logprob tests (position t - 1 scores token t)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()

def draw_every_parameter(model, seed: int) -> None:
    """Matrices (stacked experts' too) N(0, 1/fan_in) over their last axis, embeddings N(0, 1),
    norms 1 + N(0, 0.1), biases N(0, 0.1): nothing left at its HF initial value (a bias of 0
    or a norm of 1 would hide a dropped parameter)."""
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
                p.copy_(z / p.shape[-1] ** 0.5)


def write(name: str, path: Path, **overrides):
    """The HF model of family `name` (its config fields changed by `overrides`) in f32,
    saved (safetensors) to `path`."""
    cls, extra = FAMILIES[name]
    config = getattr(transformers, cls)(**{**SMALL, **extra, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    draw_every_parameter(model, seed=sorted(FAMILIES).index(name))
    model.save_pretrained(path, safe_serialization=True)
    return model


def checkpoint_fixture(write):
    """A module-scoped `checkpoints` fixture: name -> (name, HF model in f32, checkpoint
    directory), each written once by `write(name, path)`."""

    @pytest.fixture(scope="module")
    def checkpoints(tmp_path_factory):
        made = {}

        def get(name):
            if name not in made:
                path = tmp_path_factory.mktemp(name)
                made[name] = name, write(name, path), path
            return made[name]

        return get

    return checkpoints


def layout_reference_fixture(write, names, new_tokens: int = NEW_TOKENS):
    """A module-scoped fixture over `names`: (checkpoint directory written by `write`, HF's
    greedy tokens of each prompt, `new_tokens` long)."""

    @pytest.fixture(scope="module", params=names)
    def reference(request, tmp_path_factory):
        path = tmp_path_factory.mktemp(request.param)
        model = write(request.param, path)
        return path, [hf_greedy(model, ids, new_tokens) for ids in PROMPTS]

    return reference


def assert_layout_pair_matches_hf(reference, prefill: str, decode: str,
                                  new_tokens: int = NEW_TOKENS) -> None:
    """An f32 engine on cpu-8 with `prefill` and `decode` layouts gives HF's greedy tokens of
    every prompt and re-shards between them at least once."""
    from jaxpipe import Engine, EngineConfig, SamplingParams

    path, want = reference
    engine = Engine(EngineConfig(model=str(path), mesh="cpu-8", prefill=prefill, decode=decode,
                                 dtype="float32", max_model_len=160, max_num_seqs=4,
                                 max_num_batched_tokens=32, warmup=False, show_progress=False))
    outs = engine.generate(prompt_token_ids=PROMPTS,
                           sampling_params=SamplingParams(temperature=0.0, max_tokens=new_tokens))
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert engine.stats()["reshards"] >= 1


def hf_greedy(model, ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """HF's greedy continuation of one unpadded prompt, exactly new_tokens long."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def write_gguf(model, arch: str, path: Path) -> None:
    """`model`'s f32 weights and hyperparameters as a GGUF of architecture `arch` (qwen2,
    qwen3, gemma2, gemma3, phi3) written with the `gguf` package as llama.cpp's
    convert_hf_to_gguf.py writes them: tensor names from gguf's own name map, Gemma's norms
    stored as 1 + w, the Gemma and Phi keys llama.cpp reads."""
    c = model.config
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        value = tensor.float()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            value = value + 1.0
        tensors[name] = value.numpy()
    finish_gguf(gguf_writer(model, arch, path), arch, c.num_hidden_layers, tensors)


def gguf_writer(model, arch: str, path: Path):
    """A `gguf.GGUFWriter` at `path` holding `model`'s hyperparameters under architecture
    `arch`'s keys (and a small byte-level vocabulary); its tensors still to add."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)  # Gemma 3: the global
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    # A byte-level vocabulary (bytes, then one merge's "AB"): what an engine loading the
    # file needs to start; the tests feed token ids.
    tokens = [chr(b) if 33 <= b <= 126 else chr(256 + b) for b in range(c.vocab_size - 1)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list([*tokens, "AB"])
    w.add_token_types([1] * c.vocab_size)
    w.add_token_merges(["A B"])
    if arch.startswith("gemma"):
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "phi3":  # transformers' reader defaults Phi-3's padding token to 32000
        w.add_pad_token_id(0)
        w.add_rope_dimension_count(int(head_dim * c.rope_parameters["partial_rotary_factor"]))
        if c.rope_parameters.get("rope_type") == "longrope":  # llama.cpp: factors as tensors
            w.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
            for kind in ("long", "short"):
                w.add_tensor(f"rope_factors_{kind}.weight",
                             np.asarray(c.rope_parameters[f"{kind}_factor"], np.float32))
    return w


def finish_gguf(w, arch: str, layers: int, tensors: dict[str, np.ndarray]) -> None:
    """Add `tensors` (HF names -> arrays) to `w` under the GGUF names gguf's own name map
    gives them for `arch`, and write the file."""
    import gguf

    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(model_arch, layers)
    for name, value in tensors.items():
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_forward_matches_hf(model, cfg, values, atol: float = 1e-4, rtol: float = 0.0) -> None:
    """jaxpipe's cache-free forward on (cfg, values) gives `model`'s logits on every prompt,
    within atol + rtol * |HF's logit|."""
    import jax.numpy as jnp

    from jaxpipe.model.decoder import Decoder

    decoder = Decoder(cfg, dtype=jnp.float32, values=values)
    for ids in PROMPTS:
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].float().numpy()
        got = np.asarray(decoder.forward(jnp.asarray([ids])))[0]
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
