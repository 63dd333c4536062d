"""`scripts/bench_samples.py`'s logic on the two-layer SmolLM2 of tests/conftest.py: the record
has the timings, ratios and the machine, the prompt counted once and each sample past the
first computing one token again; bad flags are refused naming the field."""

from __future__ import annotations

import json

import pytest

from jaxpipe_bench.samples import SamplesBenchConfig, format_record, run


def test_a_small_run_records_ratios_and_the_prompt_counted_once(tiny_smollm2, tmp_path):
    config = SamplesBenchConfig(samples=3, input_len=40, output_len=2, repeats=2,
                                model=tiny_smollm2, dtype="float32",
                                json_path=str(tmp_path / "out.json"))
    record = run(config)
    assert json.loads((tmp_path / "out.json").read_text()) == record
    assert len(record["one_s"]) == len(record["n_s"]) == 2
    assert record["ratio_median"] > 0 and record["machine"]["cpu_model"]
    assert (record["prompt_tokens"], record["prefill_tokens"]) == (40, 40 + 2)
    assert record["forked_samples"] == 2
    assert "n=3 / n=1" in format_record(record)


@pytest.mark.parametrize("field", ["samples", "input_len", "output_len", "repeats"])
def test_counts_must_be_positive(field):
    with pytest.raises(ValueError, match=f"SamplesBenchConfig.{field}"):
        SamplesBenchConfig(**{field: 0})
