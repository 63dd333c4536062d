"""Mixtures of experts as GGUF files (qwen3moe; qwen2moe with its shared expert; Mixtral as
llama.cpp writes it, `llama` with experts and permuted Q/K rows), written with the `gguf`
package from a tiny transformers checkpoint (tests/hf_moe.py): jaxpipe's GGUF loader must give
exactly the weights and architecture its HF-directory loader gives (itself checked against HF in
test_moe_hf.py), HF's prompt logits, and in the engine HF's greedy tokens. transformers' own GGUF
reader, an independent reading of the file, rebuilds the same Qwen-MoE models from it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from hf_families import PROMPTS, assert_forward_matches_hf, hf_greedy  # noqa: E402
from hf_moe import GGUF_ARCH, write, write_gguf  # noqa: E402

from jaxpipe import Engine, EngineConfig, SamplingParams  # noqa: E402
from jaxpipe.model import gguf_file, hf_dir  # noqa: E402

NEW_TOKENS = 16


@pytest.fixture(scope="module", params=sorted(GGUF_ARCH))
def gguf_pair(request, tmp_path_factory):
    """(MODELS' name, HF model, its HF directory, the GGUF file of the same weights in a
    directory of its own)."""
    path = tmp_path_factory.mktemp(request.param)
    model = write(request.param, path)
    file = tmp_path_factory.mktemp(request.param + "_gguf") / "model.gguf"
    write_gguf(model, request.param, file)
    return request.param, model, path, file


def test_the_file_has_llama_cpps_expert_tensors(gguf_pair):
    """The names and shapes llama.cpp loads (ggml order: ffn_gate_exps {E, F, X})."""
    name, model, _, file = gguf_pair
    c = model.config
    experts = getattr(c, "num_experts", None) or c.num_local_experts
    width = c.intermediate_size if name == "mixtral" else c.moe_intermediate_size
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in gguf.GGUFReader(str(file)).tensors}
    assert shapes["blk.1.ffn_gate_exps.weight"] == (c.hidden_size, width, experts)
    assert shapes["blk.1.ffn_down_exps.weight"] == (width, c.hidden_size, experts)
    assert shapes["blk.1.ffn_gate_inp.weight"] == (c.hidden_size, experts)
    assert ("blk.1.ffn_gate_shexp.weight" in shapes) == (name == "qwen2_moe")


def test_gguf_loads_the_weights_and_architecture_of_the_hf_directory(gguf_pair):
    _, _, path, file = gguf_pair
    hf_cfg, hf_values = hf_dir.load_hf_dir(path)
    cfg, values = gguf_file.load_gguf(file)
    # The file has a tokenizer and the HF directory no special tokens; GGUF stores the norm
    # epsilon as float32: compare the rest exactly.
    assert cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps, rel=1e-6)
    same = dict(bos_token_id=None, eos_token_ids=(), rms_norm_eps=hf_cfg.rms_norm_eps)
    assert dataclasses.replace(cfg, **same) == dataclasses.replace(hf_cfg, **same)
    assert set(values) == set(hf_values)
    for name, value in values.items():
        np.testing.assert_array_equal(value, hf_values[name], err_msg=name)


def test_gguf_logits_match_hf(gguf_pair):
    _, model, _, file = gguf_pair
    assert_forward_matches_hf(model, *gguf_file.load_gguf(file))


def test_engine_on_the_gguf_gives_hf_greedy_tokens(gguf_pair):
    _, model, _, file = gguf_pair
    engine = Engine(EngineConfig(model=str(file), dtype="float32", max_model_len=160,
                                 max_num_seqs=4, max_num_batched_tokens=32, warmup=False,
                                 show_progress=False))
    outs = engine.generate(prompt_token_ids=PROMPTS,
                           sampling_params=SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS]


def test_transformers_reads_the_file_as_the_same_model(gguf_pair):
    name, model, _, file = gguf_pair
    if name == "mixtral":
        pytest.skip("transformers' GGUF reader takes a `llama` file for a dense Llama")
    # Its reader leaves the experts' widths at the config class's defaults
    # (expert_feed_forward_length unread): it gets the model's config, and reads the weights.
    again = transformers.AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, config=model.config, dtype=torch.float32)
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        np.testing.assert_allclose(again(ids).logits.numpy(), model(ids).logits.numpy(),
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch, experts, match", [
    ("qwen3moe", None, r"GGUF qwen3moe has no qwen3moe.expert_count \(or 0\)"),
    ("qwen2", 4, r"GGUF qwen2 with qwen2.expert_count=4 is not supported; experts are "
                 r"supported in: llama, mistral, qwen2moe, qwen3moe"),
])
def test_expert_metadata_jaxpipe_cannot_run_fails_naming_the_key(tmp_path, arch, experts, match):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    for add, value in [(w.add_embedding_length, 16), (w.add_block_count, 1),
                       (w.add_feed_forward_length, 24), (w.add_head_count, 2),
                       (w.add_vocab_size, 32), (w.add_expert_used_count, 2)]:
        add(value)
    if experts:
        w.add_expert_count(experts)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(ValueError, match=match):
        gguf_file.gguf_config(gguf.GGUFReader(str(tmp_path / "m.gguf")))


def test_a_layer_without_experts_fails_naming_it(tmp_path):
    """Dense layers among the MoE ones (HF's mlp_only_layers): llama.cpp's qwen2moe/qwen3moe
    need experts in every layer and gguf's tensor maps have no dense ffn_gate for them, so
    a file whose layer 1 has ffn_gate/up/down instead of ffn_*_exps is refused naming it."""
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen3moe")
    for add, value in [(w.add_embedding_length, 4), (w.add_block_count, 2),
                       (w.add_feed_forward_length, 6), (w.add_head_count, 2),
                       (w.add_vocab_size, 32), (w.add_expert_count, 2),
                       (w.add_expert_used_count, 1), (w.add_expert_feed_forward_length, 6)]:
        add(value)
    w.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((2, 6, 4), np.float32))
    w.add_tensor("blk.1.ffn_gate.weight", np.zeros((6, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"GGUF qwen3moe layer 1 has no experts \(no "
                                         r"blk.1.ffn_gate_exps.weight\)"):
        gguf_file.gguf_config(gguf.GGUFReader(str(tmp_path / "m.gguf")))
