"""`scripts/bench_structured.py`'s logic on the two-layer SmolLM2 of tests/conftest.py: every
constrained output fits the schema by pydantic's own validation (the schema is the pydantic
model's), the record has each engine's runs and medians, and each ratio is the quotient of the
two medians; bad flags are refused naming the field."""

from __future__ import annotations

import json
import statistics
from typing import Annotated

import pydantic
import pytest

from jaxpipe_bench.structured import StructuredBenchConfig, format_record, run


class Item(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    name: Annotated[str, pydantic.StringConstraints(max_length=8)]
    n: Annotated[int, pydantic.Field(ge=0, le=99)]
    tags: Annotated[list[Annotated[str, pydantic.StringConstraints(max_length=4)]],
                    pydantic.Field(max_length=2)]


@pytest.mark.parametrize("match_lengths", [False, True])
def test_a_small_run_fits_the_schema_and_records_the_medians(tiny_smollm2, tmp_path,
                                                              match_lengths):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(Item.model_json_schema()))
    # at most ~40 tokens of JSON: 64 leave every constrained output room to finish
    config = StructuredBenchConfig(num_prompts=3, input_len=8, output_len=64, repeats=2,
                                   schema=str(schema), max_num_seqs=4, model=tiny_smollm2,
                                   dtype="float32", json_path=str(tmp_path / "out.json"),
                                   match_lengths=match_lengths)
    record = run(config)
    assert json.loads((tmp_path / "out.json").read_text()) == record
    for steps in ("skip", "land"):
        texts = record["last_outputs"][f"{steps}/json"]
        assert len(texts) == 3
        for text in texts:
            Item.model_validate_json(text)  # raises unless it parses and fits
    runs = record["runs"]
    assert [(r["constrained_steps"], r["kind"]) for r in runs] == [
        (s, k) for s in ("skip", "land") for _ in range(2) for k in ("unconstrained", "json")]
    for row in record["summary"]:
        mine = [r for r in runs if (r["constrained_steps"], r["kind"])
                == (row["constrained_steps"], row["kind"])]
        base = [r for r in runs if (r["constrained_steps"], r["kind"])
                == (row["constrained_steps"], "unconstrained")]
        tok_s = [r["output_tokens"] / r["wall_s"] for r in mine]
        assert row["median_output_tok_s"] == pytest.approx(statistics.median(tok_s))
        assert row["ratio"] == pytest.approx(
            statistics.median(tok_s) / statistics.median(r["output_tokens"] / r["wall_s"]
                                                         for r in base))
        assert all(r["steps"] > 0 and r["engine_thread_cpu_s"] > 0 for r in mine)
        if row["kind"] == "json":
            assert row["fit_schema_rate"] == row["stopped_rate"] == 1.0
            assert all(r["finish_reasons"] == {"stop": 3} for r in mine)
    lengths = {(r["constrained_steps"], r["kind"]): r["output_tokens"] for r in runs}
    unconstrained = {r["finish_reasons"].get("length") for r in runs
                     if r["kind"] == "unconstrained"}
    if match_lengths:  # as many tokens as the constrained twin, each one to its max_tokens
        assert lengths[("skip", "unconstrained")] == lengths[("skip", "json")] < 3 * 64
        assert unconstrained == {3}
    else:
        assert lengths[("skip", "unconstrained")] == 3 * 64  # the random model meets no EOS
    assert record["machine"]["cpu_model"] and record["machine"]["isa"]
    assert " json " in format_record(record) and "CPU ms/step" in format_record(record)


@pytest.mark.parametrize("field", ["num_prompts", "output_len", "repeats", "max_num_seqs"])
def test_counts_must_be_positive(field):
    with pytest.raises(ValueError, match=f"StructuredBenchConfig.{field}"):
        StructuredBenchConfig(**{field: 0})


def test_a_schema_it_cannot_check_is_refused(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"type": "string", "pattern": "^a+$"}))
    with pytest.raises(ValueError, match=r"schema .*'pattern'"):
        StructuredBenchConfig(schema=str(path))
    with pytest.raises(ValueError, match="StructuredBenchConfig.schema .*cannot read"):
        StructuredBenchConfig(schema=str(tmp_path / "missing.json"))
