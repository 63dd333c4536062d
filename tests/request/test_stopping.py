"""StopChecker with the real SmolLM2 tokenizer and no model: tokens are fed by hand, folded into
the request's `outputs.Completion` as the engine does, and the expected cut points are computed
with plain string operations on the decoded text."""

from __future__ import annotations

import pytest

from jaxpipe import SamplingParams
from jaxpipe.model.tokenizer import Tokenizer
from jaxpipe.request.outputs import Completion, token_delta
from jaxpipe.request.stopping import StopChecker, TextStream, final_text
from jaxpipe.scheduler import Sequence

EOS = 2
EOS_IDS = frozenset({EOS})
MAX_LEN = 1000
PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok(gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def prompt_ids(tok) -> list[int]:
    return tok.encode(PROMPT)


def feed(tok, prompt_ids, output_ids, stream: bool = False, max_tokens: int = 100, **params):
    """Push `output_ids` one at a time until a stop; returns (seq, reason, completion, deltas):
    the streamed text deltas, or, unstreamed, the completion folded once at the end."""
    p = SamplingParams(max_tokens=max_tokens, **params)
    checker = StopChecker(tok, prompt_ids, p, EOS_IDS)
    seq = Sequence.create("r", list(prompt_ids), p, 0, max_tokens)
    completion = Completion(seq, tok, stream=stream)
    reason, deltas = None, []
    for token in output_ids:
        seq.output_token_ids.append(token)
        reason = checker.check(seq, MAX_LEN)
        if reason is not None:
            seq.finish_reason = reason
        if stream:
            deltas.append(completion.add(token_delta(seq, len(completion.token_ids))))
        if reason is not None:
            break
    if not stream:
        seq.finish_reason = seq.finish_reason or "length"  # decoded once, at a finish
        completion.add(token_delta(seq))
    return seq, reason, completion, deltas


def test_eos_stops_with_no_stop_reason(tok, prompt_ids):
    ids = tok.encode("Hello there!") + [EOS, 42, 43]
    seq, reason, completion, _ = feed(tok, prompt_ids, ids)
    assert reason == "stop" and seq.stop_reason is None
    assert seq.output_token_ids == ids[:-2]
    assert completion.text == "Hello there!"


def test_ignore_eos_runs_to_max_tokens(tok, prompt_ids):
    ids = tok.encode("Hi") + [EOS] + tok.encode(" again and again")
    seq, reason, _, _ = feed(tok, prompt_ids, ids, ignore_eos=True, max_tokens=len(ids) - 1)
    assert reason == "length" and len(seq.output_token_ids) == len(ids) - 1


def test_stop_token_id_is_the_stop_reason(tok, prompt_ids):
    ids = tok.encode("one two three four")
    seq, reason, _, _ = feed(tok, prompt_ids, ids, stop_token_ids=[ids[2]])
    assert reason == "stop" and seq.stop_reason == ids[2]
    assert seq.output_token_ids == ids[:3]


def test_max_tokens_and_max_model_len_give_length(tok, prompt_ids):
    ids = tok.encode("a b c d e f g h")
    seq, reason, _, _ = feed(tok, prompt_ids, ids, max_tokens=3)
    assert reason == "length" and len(seq.output_token_ids) == 3
    p = SamplingParams(max_tokens=None)
    checker = StopChecker(tok, prompt_ids, p, EOS_IDS)
    seq = Sequence.create("r", list(prompt_ids), p, 0, MAX_LEN)
    seq.output_token_ids.append(ids[0])
    assert checker.check(seq, len(prompt_ids) + 2) is None
    seq.output_token_ids.append(ids[1])
    assert checker.check(seq, len(prompt_ids) + 2) == "length"


def test_min_tokens_bans_stop_ids_then_lifts_the_ban(tok, prompt_ids):
    p = SamplingParams(min_tokens=3, stop_token_ids=[50, 7])
    checker = StopChecker(tok, prompt_ids, p, EOS_IDS)
    assert [checker.banned(n) for n in range(5)] == [[EOS, 7, 50]] * 3 + [[], []]


def test_eos_before_min_tokens_does_not_stop(tok, prompt_ids):
    ids = tok.encode("Hi") + [EOS] + tok.encode(" there friend") + [EOS]
    seq, reason, _, _ = feed(tok, prompt_ids, ids, min_tokens=len(ids) - 1)
    assert reason == "stop" and seq.output_token_ids == ids


def test_ignore_eos_lifts_the_eos_ban(tok, prompt_ids):
    checker = StopChecker(tok, prompt_ids, SamplingParams(min_tokens=2, ignore_eos=True),
                          EOS_IDS)
    assert checker.banned(0) == []


STOP_CASES = [  # (generated text, stop strings)
    ("The answer is 42. Done.", ["42"]),
    ("The answer is 42. Done.", [" answer is"]),
    ("Line one\nLine two\nLine three", ["\nLine t"]),
    ("naïve café 😀 end", ["😀"]),
    ("no match in here", ["zebra"]),
    ("abc abc abd", ["abd", "zzz"]),
]


def _expected(text: str, stops: list[str]) -> str:
    found = [text.index(s) for s in stops if s in text]
    return text[:min(found)] if found else text


@pytest.mark.parametrize("text, stops", STOP_CASES)
def test_stop_string_cuts_the_text(tok, prompt_ids, text, stops):
    ids = tok.encode(text)
    seq, reason, completion, _ = feed(tok, prompt_ids, ids, stop=stops)
    assert completion.text == _expected(text, stops)
    if any(s in text for s in stops):
        assert reason == "stop" and seq.stop_reason in stops
        # It stops at the first token whose text completes the stop string.
        k = len(seq.output_token_ids)
        assert any(s in tok.decode(ids[:k]) for s in stops)
        assert not any(s in tok.decode(ids[:k - 1]) for s in stops)
    else:
        assert reason is None


@pytest.mark.parametrize("text, stops", STOP_CASES)
def test_streamed_text_equals_final_text(tok, prompt_ids, text, stops):
    ids = tok.encode(text) + [EOS]
    seq, _, completion, deltas = feed(tok, prompt_ids, ids, stream=True, stop=stops)
    assert "".join(deltas) == completion.text == _expected(text, stops)
    _, _, whole, _ = feed(tok, prompt_ids, ids, stop=stops)
    assert whole.text == completion.text


def test_streaming_without_stop_strings_matches_decode(tok, prompt_ids):
    text = "Emoji 👩‍👩‍👧 and 日本語 and spaces  here."
    ids = tok.encode(text) + [EOS]
    seq, reason, completion, deltas = feed(tok, prompt_ids, ids, stream=True)
    assert reason == "stop"
    assert "".join(deltas) == text == completion.text


def test_stop_strings_need_a_tokenizer(prompt_ids):
    with pytest.raises(ValueError, match="tokenizer"):
        StopChecker(None, prompt_ids, SamplingParams(stop=["x"]), EOS_IDS)


def test_stream_deltas_concatenate_to_the_final_text_and_hold_back_stop_strings(tok):
    ids = tok.encode("Roses are red. Violets are blue. Sugar is sweet.",
                           add_special_tokens=False)
    # The engine stops at the token that completes "blue"; stream everything before it.
    k = next(k for k in range(1, len(ids) + 1) if "blue" in tok.decode(ids[:k]))
    stream = TextStream(tok, [1], True, stop=["blue"])
    shown = "".join(stream.push([t]) for t in ids[:k - 1])
    assert shown.startswith("Roses are red.")
    assert len(shown) <= len(tok.decode(ids[:k - 1])) - 3  # "blu" could start "blue"
    full = shown + stream.finish(ids[k - 1:k], "blue")
    assert full == "Roses are red. Violets are "  # the stop string is cut
    assert full == final_text(tok, ids[:k], True, "blue")


def test_final_text_without_a_stop_string_is_the_decoded_text(tok):
    ids = tok.encode("Hello there", add_special_tokens=False) + [2]
    assert final_text(tok, ids, True, 2) == "Hello there"
    assert final_text(tok, ids, False, None).endswith("<|im_end|>")


@pytest.mark.parametrize("text, stops", STOP_CASES)
def test_include_stop_str_in_output_keeps_the_stop_string(tok, prompt_ids, text, stops):
    ids = tok.encode(text) + [EOS]
    found = [(text.index(s), s) for s in stops if s in text]
    want = text[:min(found)[0] + len(min(found)[1])] if found else text
    for stream in (False, True):
        seq, _, completion, deltas = feed(tok, prompt_ids, ids, stream=stream, stop=stops,
                                          include_stop_str_in_output=True)
        assert completion.text == want
        if stream:
            assert "".join(deltas) == want


def _vllm_bad_word_bans(words: list[list[int]], output: list[int]) -> set[int]:
    """vLLM V1's `_apply_bad_words_single_batch`, restated: the last token of each word whose
    other tokens end the output so far."""
    bans = set()
    for word in words:
        if len(word) > len(output) + 1:
            continue
        prefix = len(word) - 1
        if (output[-prefix:] if prefix else []) == word[:-1]:
            bans.add(word[-1])
    return bans


def test_bad_words_are_tokenized_as_vllm_does(tok):
    from jaxpipe.request.stopping import bad_words_token_ids

    words = ["Paris", "the capital of France", "unbelievably", " world"]
    want = []
    for w in words:  # each as written and with a leading space when that is another word
        plain = tok.encode(w.lstrip(), add_special_tokens=False)
        spaced = tok.encode(" " + w.lstrip(), add_special_tokens=False)
        want += [plain] + ([spaced] if len(spaced) == len(plain) and spaced[0] != plain[0]
                           else [])
    assert bad_words_token_ids(tok, words) == want
    assert [7042] in want and [38634] in want  # " Paris" and "Paris" are both single tokens


def test_bad_words_ban_single_tokens_always_and_a_last_token_after_its_prefix(tok, prompt_ids):
    import random

    from jaxpipe.request.stopping import bad_words_token_ids

    words = ["Paris", "the capital of France", "unbelievably"]
    ids = bad_words_token_ids(tok, words)
    p = SamplingParams(bad_words=words, min_tokens=2)
    checker = StopChecker(tok, prompt_ids, p, EOS_IDS)
    assert checker.needs_history
    assert not StopChecker(tok, prompt_ids, SamplingParams(bad_words=["Paris"]),
                           EOS_IDS).needs_history
    rng = random.Random(0)
    pool = sorted({t for w in ids for t in w}) + [5, 6, 7]
    for trial in range(300):
        output = [rng.choice(pool) for _ in range(rng.randint(0, 6))]
        if trial % 3 == 0:  # end with a word's prefix
            word = rng.choice([w for w in ids if len(w) > 1])
            output += word[:-1]
        want = _vllm_bad_word_bans(ids, output) | (set(EOS_IDS) if len(output) < 2 else set())
        assert checker.banned(len(output), output) == sorted(want)
    assert checker.banned(3, [9, 1195, 3575]) == [7042, 38634]  # singles only: prefix short
    assert checker.banned(4, [9, 1195, 3575, 282]) == [4649, 7042, 38634]
    assert checker.banned(4, [9, 260, 3575, 282]) == [4649, 7042, 38634]
    with pytest.raises(RuntimeError, match="on the host"):
        checker.banned(3, [1, 2])  # a token still in flight: the ban cannot be known


def test_bad_words_need_a_tokenizer(prompt_ids):
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        StopChecker(None, prompt_ids, SamplingParams(bad_words=["x"]), EOS_IDS)
