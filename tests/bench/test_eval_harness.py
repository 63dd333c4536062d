"""scripts/eval_harness.py's comparison of two lm-eval runs, on sample files written here."""

from __future__ import annotations

import json
from pathlib import Path

from jaxpipe_bench import eval_harness as eh


def _write(run: Path, task: str, rows: list[dict]) -> None:
    d = run / "model"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"samples_{task}_2026.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _runs(tmp_path: Path, jp_lls: list[float], jp_text: str) -> tuple[Path, Path]:
    hf, jp = tmp_path / "hf", tmp_path / "jp"
    for run, lls, text in ((hf, [-1.0, -2.5], " Rome"), (jp, jp_lls, jp_text)):
        acc = float(lls.index(max(lls)) == 0)
        _write(run, eh.MC_TASK, [{"doc_id": 0, "resps": [[[ll, False]] for ll in lls],
                                  "acc": acc, "acc_norm": acc}])
        _write(run, eh.GEN_TASK, [{"doc_id": 0, "filtered_resps": [text],
                                   "exact_match": float(text == " Rome")}])
    return hf, jp


def test_runs_that_agree_within_the_tolerance_agree(tmp_path):
    result = eh.compare(*_runs(tmp_path, [-1.0004, -2.5], " Rome"))
    assert abs(result["max_loglikelihood_diff"] - 4e-4) < 1e-9
    assert eh.agrees(result, 1e-3)


def test_a_loglikelihood_off_by_more_than_the_tolerance_disagrees(tmp_path):
    result = eh.compare(*_runs(tmp_path, [-1.0, -2.502], " Rome"))
    assert not eh.agrees(result, 1e-3)


def test_a_different_generation_or_accuracy_disagrees(tmp_path):
    result = eh.compare(*_runs(tmp_path, [-3.0, -2.5], " Paris"))
    assert result["generations_differ"] == [0]
    assert result["mc_acc"] == {"hf": 1.0, "jaxpipe": 0.0}
    assert not eh.agrees(result, 10.0)


def test_the_tasks_are_written_with_every_document(tmp_path):
    root = eh.write_tasks(tmp_path)
    mc = (root / f"{eh.MC_TASK}.jsonl").read_text().splitlines()
    assert len(mc) == len(eh.MC_DOCS)
    assert all(0 <= json.loads(d)["answer"] < len(json.loads(d)["choices"]) for d in mc)
    assert str(root / f"{eh.GEN_TASK}.jsonl") in (root / f"{eh.GEN_TASK}.yaml").read_text()
