"""Weight loading: an HF safetensors directory written by transformers loads to exactly the GGUF
loader's weights; orbax checkpoints round-trip; bad paths fail naming the path."""

from __future__ import annotations

import copy
import os
import re
import shutil

import numpy as np
import pytest

from jaxpipe import Engine, EngineConfig, SamplingParams
from jaxpipe.model import gguf_file, loading, orbax_dir
from jaxpipe.model import hf_dir as hf_dir_module
from jaxpipe.model.hf_dir import hf_config
from jaxpipe.model.presets import resolve_model
from jaxpipe.model.tokenizer import Tokenizer

pytest.importorskip("torch")

PROMPTS = ["The capital of France is", "def fib(n):"]


@pytest.fixture(scope="module")
def hf_dir(hf_model, gguf_path, tmp_path_factory):
    """The HF reference model saved with `save_pretrained`, and the GGUF's tokenizer written
    by jaxpipe (as its metadata says, whichever transformers release is installed: 5.5 reads
    SmolLM2's GGUF as a CodeLlama tokenizer); removed after the module."""
    path = tmp_path_factory.mktemp("hf_smollm2")
    # A GGUF-loaded model is flagged as quantized (transformers >= 5.6) and refuses to save:
    # copy its (already dequantized) weights into a plain model of the same config.
    config = copy.deepcopy(hf_model.config)
    config.__dict__.pop("quantization_config", None)
    plain = type(hf_model)(config)
    plain.load_state_dict(hf_model.state_dict())
    plain.save_pretrained(path)
    Tokenizer.from_gguf(gguf_path).save(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)  # 540 MB of float32: not kept past this module


def test_gguf_config_matches_transformers(gguf_weights, hf_model):
    cfg, _ = gguf_weights
    assert cfg == hf_config(hf_model.config.to_dict())
    assert cfg.num_params() == sum(p.numel() for p in hf_model.parameters())


def test_hf_dir_resolves_as_hf(hf_dir):
    source = resolve_model(str(hf_dir))
    assert source.kind == "hf" and source.path == hf_dir


def test_hf_dir_weights_equal_gguf_weights(hf_dir, gguf_weights):
    cfg, values = gguf_weights
    hf_cfg, hf_values = loading.load_weights(resolve_model(str(hf_dir)))
    assert hf_cfg == cfg
    assert set(hf_values) == set(values)
    for name, value in values.items():
        np.testing.assert_array_equal(np.asarray(hf_values[name]), np.asarray(value),
                                      err_msg=name)


def test_hf_dir_load_reads_each_checkpoint_tensor_once(hf_dir, monkeypatch):
    """The load reads a tensor when the decoder's parameters ask for it, and only then: each
    of the checkpoint's tensors once (the files' own key lists: the independent count)."""
    from safetensors import safe_open

    reads: dict[str, int] = {}

    class Counted:
        def __init__(self, handle):
            self._handle = handle

        def __enter__(self):
            self._handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self._handle.__exit__(*exc)

        def keys(self):
            return self._handle.keys()

        def get_tensor(self, name):
            reads[name] = reads.get(name, 0) + 1
            return self._handle.get_tensor(name)

    monkeypatch.setattr(hf_dir_module, "safe_open", lambda *a, **k: Counted(safe_open(*a, **k)))
    loading.load_weights(resolve_model(str(hf_dir)))
    names = set()
    for file in hf_dir.glob("*.safetensors"):
        with safe_open(str(file), framework="np") as handle:
            names |= set(handle.keys())
    assert reads == dict.fromkeys(names, 1)


def test_engine_on_hf_dir_matches_gguf_engine(hf_dir, engine):
    hf_engine = Engine(EngineConfig(**{**_kwargs(engine), "model": str(hf_dir)}))
    assert hf_engine.tokenizer is not None
    for prompt in PROMPTS:
        assert hf_engine.tokenizer.encode(prompt) == engine.tokenizer.encode(prompt)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    got = [o.outputs[0].token_ids for o in hf_engine.generate(PROMPTS, params)]
    want = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, params)]
    assert got == want


def _kwargs(engine) -> dict:
    c = engine.config
    return dict(dtype=c.dtype, max_model_len=c.max_model_len, max_num_seqs=c.max_num_seqs,
                warmup=False, show_progress=False)


def test_orbax_round_trip(tmp_path, gguf_weights):
    cfg, values = gguf_weights
    orbax_dir.save_orbax(tmp_path / "ckpt", cfg, values, "float32")
    assert resolve_model(str(tmp_path / "ckpt")).kind == "orbax"
    restored_cfg, restored = orbax_dir.load_orbax(tmp_path / "ckpt")
    assert restored_cfg == cfg
    assert set(restored) == set(values)
    for name, value in values.items():
        got = np.asarray(restored[name])
        assert got.dtype == np.float32, name
        np.testing.assert_array_equal(got, np.asarray(value), err_msg=name)


# ---- bad paths --------------------------------------------------------------------------------


def test_missing_path_names_it(tmp_path):
    path = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=re.escape(str(path))):
        resolve_model(str(path))


def test_directory_without_weights_names_it(tmp_path):
    with pytest.raises(ValueError, match=re.escape(str(tmp_path))):
        resolve_model(str(tmp_path))


def test_file_that_is_not_gguf_names_it(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match=re.escape(str(path))):
        resolve_model(str(path))


def test_hf_dir_without_safetensors_names_it(tmp_path, hf_dir):
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    with pytest.raises((ValueError, FileNotFoundError), match=re.escape(str(tmp_path))):
        loading.load_weights(resolve_model(str(tmp_path)))


def test_corrupt_gguf_fails_at_engine_construction_naming_it(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match=re.escape(str(path))):
        Engine(EngineConfig(model=str(path), warmup=False, show_progress=False))


def _write_gguf(path, arch: str) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("x", np.arange(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_file_is_parsed_once_until_it_changes(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama")
    first = gguf_file.open_gguf(path)
    assert gguf_file.open_gguf(str(path)) is first
    _write_gguf(path, "a-longer-architecture")  # another size: parsed again
    again = gguf_file.open_gguf(path)
    assert again is not first
    assert again.fields["general.architecture"].contents() == "a-longer-architecture"


def test_a_gguf_file_moved_over_another_of_its_size_and_time_is_parsed_again(tmp_path):
    """`cp -p` / `rsync` write a new file and move it over the old one, keeping the time."""
    path, other = tmp_path / "tiny.gguf", tmp_path / "other.gguf"
    _write_gguf(path, "llama")
    _write_gguf(other, "qwen2")  # as long a name: the same size
    assert gguf_file.open_gguf(path).fields["general.architecture"].contents() == "llama"
    old = path.stat()
    os.utime(other, ns=(old.st_atime_ns, old.st_mtime_ns))
    os.replace(other, path)
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (old.st_size, old.st_mtime_ns)
    assert gguf_file.open_gguf(path).fields["general.architecture"].contents() == "qwen2"


def test_weights_load_in_the_engines_dtype_as_the_f32_load_rounded(gguf_weights):
    """Each parameter cast as the loader builds it: the f32 load rounded to bf16, exactly."""
    import ml_dtypes

    cfg, f32 = gguf_weights
    got_cfg, bf16 = loading.load_weights(resolve_model("smollm2-135m"),
                                         dtype=ml_dtypes.bfloat16)
    assert got_cfg == cfg and set(bf16) == set(f32)
    for name, value in bf16.items():
        assert value.dtype == ml_dtypes.bfloat16, name
        np.testing.assert_array_equal(value, f32[name].astype(ml_dtypes.bfloat16), name)
