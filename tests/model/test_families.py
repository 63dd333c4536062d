"""The family modules (`jaxpipe/model/families/`): the registry finds each family by its name,
its HF architectures and its GGUF architecture, and refuses others naming them; each family's
tensor-name tables cover every tensor of a tiny checkpoint of that family (HF directory and
GGUF file) and every name they give is one the decoder's parameters are built from."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import hf_families  # noqa: E402
import hf_moe  # noqa: E402
from safetensors import safe_open  # noqa: E402

from jaxpipe.model import families, gguf_file, hf_dir, tensors  # noqa: E402
from jaxpipe.model.family import Family, rename  # noqa: E402

NAMES = ["gemma2", "gemma3", "llama", "mistral", "mixtral", "phi3", "qwen2", "qwen2_moe",
         "qwen3", "qwen3_moe"]


# ---- the registry ---------------------------------------------------------------------------


def test_every_module_is_a_family_named_as_it():
    assert [f.name for f in families.all_families()] == NAMES
    assert all(isinstance(f, Family) for f in families.all_families())


@pytest.mark.parametrize("name", NAMES)
def test_lookup_by_each_vocabulary_finds_the_family(name):
    family = families.by_name(name)
    assert family.name == name
    for arch in family.hf_architectures:
        assert families.by_hf_architecture(arch) is family
        assert families.for_hf_config({"architectures": [arch]}) is family
    for model_type in family.hf_model_types:
        assert families.for_hf_config({"model_type": model_type}) is family
    for arch in family.gguf_architectures:
        assert families.by_gguf_architecture(arch, 8 if family.has_experts else 0) is family


def test_gguf_vocabulary_maps_to_the_one_name():
    """GGUF's names for the MoE families differ from HF's and jaxpipe's; `llama` with experts
    is Mixtral."""
    assert families.by_gguf_architecture("qwen2moe", 4).name == "qwen2_moe"
    assert families.by_gguf_architecture("qwen3moe", 4).name == "qwen3_moe"
    assert families.by_gguf_architecture("llama", 0).name == "llama"
    assert families.by_gguf_architecture("llama", 8).name == "mixtral"
    assert families.by_hf_architecture("Gemma3ForCausalLM").gguf_architectures == ("gemma3",)


@pytest.mark.parametrize("lookup, match", [
    (lambda: families.by_name("gpt_neox"),
     r"model family 'gpt_neox' is not supported; supported: \['gemma2', 'gemma3', 'llama'"),
    (lambda: families.by_hf_architecture("GPTNeoXForCausalLM"),
     r"HF architecture 'GPTNeoXForCausalLM' is not supported; supported: "
     r"\['Gemma2ForCausalLM', 'Gemma3ForCausalLM', 'LlamaForCausalLM', 'MistralForCausalLM', "
     r"'MixtralForCausalLM', 'Phi3ForCausalLM', 'Qwen2ForCausalLM', 'Qwen2MoeForCausalLM', "
     r"'Qwen3ForCausalLM', 'Qwen3MoeForCausalLM'\]"),
    (lambda: families.for_hf_config({"model_type": "gpt_neox"}),
     r"config.json architectures=\[\] \(model_type='gpt_neox'\) is not supported"),
    (lambda: families.by_gguf_architecture("gpt2"),
     r"GGUF architecture 'gpt2' is not supported; supported: gemma2, gemma3, llama, mistral, "
     r"phi3, qwen2, qwen2moe, qwen3, qwen3moe$"),
    (lambda: families.by_gguf_architecture("gemma2", 4),
     r"GGUF gemma2 with gemma2.expert_count=4 is not supported; experts are supported in: "
     r"llama, mistral, qwen2moe, qwen3moe"),
])
def test_an_unknown_architecture_fails_naming_it_and_the_supported(lookup, match):
    with pytest.raises(ValueError, match=match):
        lookup()


def test_rename_reads_layer_and_expert_indices():
    names = {"model.layers.{i}.mlp.experts.{x}.w1.weight": "layers.{i}.experts.{x}.gate",
             "blk.{i}.attn_q.weight": "layers.{i}.q", "output.weight": "lm_head"}
    assert rename(names, "model.layers.12.mlp.experts.7.w1.weight") == "layers.12.experts.7.gate"
    assert rename(names, "blk.3.attn_q.weight") == "layers.3.q"
    assert rename(names, "output.weight") == "lm_head"
    assert rename(names, "blk.3.attn_q.bias") is None


# ---- each family's tables cover a tiny checkpoint of it -------------------------------------

# A tiny checkpoint (tests/hf_families.py, tests/hf_moe.py) -> its family.
CHECKPOINTS = {
    **{name: name.split("_")[0] for name in hf_families.FAMILIES},
    "llama_linear": "llama", "llama_dynamic": "llama", "llama_yarn": "llama", "llama3": "llama",
    **{name: name.removesuffix("_mixed") for name in hf_moe.MODELS},
}
# One checkpoint of each family as a GGUF of the architecture llama.cpp writes it as (gguf
# 0.19 has no `mistral` to write: Mistral's table is Llama's).
GGUF_ARCH = {"llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
             "gemma3": "gemma3", "phi3": "phi3", "phi3_longrope": "phi3", **hf_moe.GGUF_ARCH}


def test_every_family_has_a_tiny_checkpoint():
    assert sorted(set(CHECKPOINTS.values())) == NAMES


class Recording(dict):
    """A dict that remembers which keys were read."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


def _write(name: str, path):
    return (hf_moe if name in hf_moe.MODELS else hf_families).write(name, path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (HF model, checkpoint directory), written once."""
    made = {}

    def get(name):
        if name not in made:
            path = tmp_path_factory.mktemp(name)
            made[name] = _write(name, path), path
        return made[name]

    return get


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_hf_names_cover_every_tensor(tiny, name):
    _, path = tiny(name)
    family = families.by_name(CHECKPOINTS[name])
    config = json.loads((path / "config.json").read_text())
    assert families.for_hf_config(config) is family
    with safe_open(str(path / "model.safetensors"), "np") as f:
        split = _named(family.hf_names, {n: f.get_tensor(n) for n in f.keys()})
    cfg = hf_dir.hf_config(config)
    split = tensors.split_fused(cfg, split)
    recorded = Recording(split)
    tensors.stack(cfg, recorded)
    assert recorded.read == set(split)


@pytest.mark.parametrize("name", sorted(GGUF_ARCH))
def test_gguf_names_cover_every_tensor(tiny, name, tmp_path):
    model, _ = tiny(name)
    file = tmp_path / "model.gguf"
    if name in hf_moe.MODELS:
        hf_moe.write_gguf(model, name, file)
    else:
        hf_families.write_gguf(model, GGUF_ARCH[name], file)
    reader = gguf.GGUFReader(str(file))
    family = gguf_file.gguf_family(reader)
    assert family.name == CHECKPOINTS[name]
    values = {t.name: np.asarray(t.data).reshape([int(n) for n in reversed(t.shape)])
              for t in reader.tensors if t.name not in family.gguf_config_tensors}
    cfg = gguf_file.gguf_config(reader)
    split = tensors.split_fused(cfg, _named(family.gguf_names, values))
    recorded = Recording(split)
    tensors.stack(cfg, recorded)
    assert recorded.read == set(split)


def _named(table: dict, values: dict) -> dict:
    """`values` under jaxpipe's names; every name must have one."""
    ours = {n: rename(table, n) for n in values}
    assert [n for n, o in ours.items() if o is None] == []
    return {ours[n]: v for n, v in values.items()}


# ---- what the family modules fixed ----------------------------------------------------------


def test_a_gemma_gguf_without_a_window_key_is_still_gemma(tmp_path):
    """Gemma's switches come from the family, not from `attention.sliding_window`: a gemma2
    file without that key used to load as a plain Llama (no sandwich norms, SiLU, no
    sqrt(E) embedding scale, no soft-caps)."""
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gemma2")
    for add, value in [(w.add_embedding_length, 16), (w.add_block_count, 2),
                       (w.add_feed_forward_length, 24), (w.add_head_count, 2),
                       (w.add_vocab_size, 32)]:
        add(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    cfg = gguf_file.gguf_config(gguf.GGUFReader(str(tmp_path / "m.gguf")))
    assert (cfg.sandwich_norms, cfg.mlp_act, cfg.embed_scale) == (True, "gelu_tanh", 4.0)
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.attn_scale) == (50.0, 30.0, 8 ** -0.5)
    assert (cfg.sliding_window, cfg.sliding_layers) == (None, ())


def test_an_hf_tensor_no_table_names_fails_the_load_naming_it(tiny, tmp_path):
    from safetensors.numpy import save_file

    _, path = tiny("qwen3")
    with safe_open(str(path / "model.safetensors"), "np") as f:
        state = {n: f.get_tensor(n) for n in f.keys()}
    state["model.layers.0.mlp.mystery.weight"] = np.zeros((2, 2), np.float32)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.mystery.weight' is not "
                                         r"one of qwen3's"):
        hf_dir.load_hf_dir(tmp_path)
