"""Cache-aware admission in batch jobs (jaxpipe/batch/lookahead.py): each window of the next
`prefix_lookahead` requests is queued in the prefix cache's order, windows in input order; a
job run so gives, custom_id by custom_id, the records of a cache-off run in input order."""

from __future__ import annotations

import json
import random

import pytest

from jaxpipe.batch.job import BatchJobConfig, Job
from jaxpipe.batch.lookahead import in_windows
from jaxpipe.batch.runners import LocalRunner

SYSTEMS = [  # each is several 16-token blocks; they differ inside their first block
    "You are a pirate. Answer every question in the voice of an old sea captain who has "
    "sailed the seven seas and fears nothing but calm water.",
    "You are a careful chef. Answer every question with a short recipe, listing the "
    "ingredients first and then the steps, and never skip the salt.",
    "You are a patient maths teacher. Answer every question by working through the problem "
    "step by step, naming each rule as you use it, before giving the result.",
]
LOOKAHEAD = 9
N = 20  # two full windows and a short one


def test_windows_are_consecutive_slices_each_in_its_own_order():
    prompts = [[i % 3] * 5 + [i] for i in range(11)]  # three groups of one-block stems
    got = list(in_windows(iter(range(11)), lambda i: prompts[i], 4, block=4))
    assert [sorted(got[k:k + 4]) for k in (0, 4, 8)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert got[:4] == [0, 1, 3, 2]  # group 0's leader, group 1's leader, group 0, group 2
    assert list(in_windows(iter(range(11)), lambda i: prompts[i], 1, block=4)) == list(range(11))
    with pytest.raises(ValueError, match="lookahead must be >= 1, got 0"):
        next(in_windows(iter(range(3)), lambda i: prompts[i], 0, block=4))


def test_the_lookahead_is_a_job_flag():
    from jaxpipe.batch.__main__ import build_parser
    from jaxpipe.config.flags import config_from_args

    p = build_parser()
    args = p.parse_args(["in.jsonl", "-o", "out.jsonl", "--prefix-lookahead", "8"])
    assert config_from_args(BatchJobConfig, args, p).prefix_lookahead == 8
    with pytest.raises(ValueError, match="prefix_lookahead must be an integer >= 1, got 0"):
        BatchJobConfig(prefix_lookahead=0)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """N completion lines, each one of SYSTEMS (shuffled, seeded) + its own question:
    (input path, system index of each line)."""
    rng = random.Random(3)
    which = [i % len(SYSTEMS) for i in range(N)]
    rng.shuffle(which)
    path = tmp_path_factory.mktemp("lookahead") / "in.jsonl"
    lines = [json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": f"{SYSTEMS[s]}\nQuestion {i}: what is {i} + {i}?",
                                  "max_tokens": 5, "temperature": 0}})
             for i, s in enumerate(which)]
    path.write_text("\n".join(lines) + "\n")
    return path, which


def run_job(model: str, path, out, lookahead: int, **engine) -> tuple[dict, list, dict]:
    """(records by custom_id, the prompts in the order the engine was given them, stats)."""
    from jaxpipe import Engine, EngineConfig

    eng = Engine(EngineConfig(model=model, dtype="float32", max_model_len=256, max_num_seqs=4,
                              warmup=False, show_progress=False, **engine))
    seen = []
    add = eng.add_request
    eng.add_request = lambda *a, **k: (seen.append(k["prompt_token_ids"]), add(*a, **k))[1]
    try:
        summary = Job(str(path), str(out), 1 << 20, progress=False).run(
            LocalRunner(eng, max_in_flight=4, prefix_lookahead=lookahead))
        stats = eng.stats()
    finally:
        eng.close()
    assert (summary.succeeded, summary.failed) == (N, 0)
    records = [json.loads(x) for x in out.read_text().splitlines()]
    return {r["custom_id"]: r["response"]["body"]["choices"][0] for r in records}, seen, stats


def test_a_job_queues_windows_by_prefix_and_gives_the_cache_off_records(tiny_smollm2, job,
                                                                       tmp_path):
    path, which = job
    want, plain, _ = run_job(tiny_smollm2, path, tmp_path / "off.jsonl", LOOKAHEAD,
                             prefix_caching=False)
    got, seen, stats = run_job(tiny_smollm2, path, tmp_path / "on.jsonl", LOOKAHEAD,
                               prefix_caching=True)
    assert {k: (c["text"], c["token_ids"]) for k, c in got.items()} == \
        {k: (c["text"], c["token_ids"]) for k, c in want.items()}
    assert stats["prefix_cache_hit_tokens"] > 0
    # cache off: the input order; on: each window of LOOKAHEAD lines, reordered within it
    line_of = {tuple(p): i for i, p in enumerate(plain)}
    assert [line_of[tuple(p)] for p in plain] == list(range(N))
    order = [line_of[tuple(p)] for p in seen]
    windows = [range(start, min(start + LOOKAHEAD, N)) for start in range(0, N, LOOKAHEAD)]
    assert not all(grouped([which[i] for i in w]) for w in windows)  # the input is mixed
    for w in windows:
        queued = order[w.start:w.stop]
        assert sorted(queued) == list(w)
        assert grouped([which[i] for i in queued]), [which[i] for i in queued]


def grouped(systems: list[int]) -> bool:
    """Whether, less each system prompt's first request (queued a group early), the
    requests of each system prompt are contiguous."""
    rest = [s for k, s in enumerate(systems) if s in systems[:k]]
    runs = [s for k, s in enumerate(rest) if k == 0 or rest[k - 1] != s]
    return len(runs) == len(set(runs))
