"""Engine flags derived from EngineConfig (jaxpipe/engine_flags.py): every field has a flag
with its docstring text, values reach EngineConfig with the field's type, and a bad value
is the parser's error naming it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from jaxpipe.config import EngineConfig
from jaxpipe.engine_flags import NOT_FLAGS, add_engine_args, engine_kwargs, field_docs


@pytest.fixture
def parser():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_every_field_has_a_documented_flag(parser):
    docs = field_docs()
    options = {a.dest: a for a in parser._actions}
    for field in dataclasses.fields(EngineConfig):
        if field.name in NOT_FLAGS:
            continue
        assert len(docs.get(field.name, "")) > 20, f"EngineConfig.{field.name} has no doc entry"
        action = options[field.name]
        assert action.option_strings[0] == "--" + field.name.replace("_", "-")
        assert docs[field.name].split()[0] in action.help


def test_values_reach_the_config_with_the_fields_types(parser):
    args = parser.parse_args(["--max-num-seqs", "12", "--memory-utilization", "0.25",
                              "--no-overlap", "--prefill", "pp=1", "--no-warmup"])
    kwargs = engine_kwargs(args, parser)
    assert kwargs == {"max_num_seqs": 12, "memory_utilization": 0.25, "overlap": False,
                      "prefill": "pp=1", "warmup": False}
    assert engine_kwargs(parser.parse_args([]), parser) == {}  # EngineConfig's defaults apply
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-num-seqs", "many"])


def test_help_shows_defaults_that_are_values(parser):
    text = parser.format_help()
    assert "(default: 4096)" in text and "(default: on)" in text


def test_scheduler_flags_reach_engine_config(parser, capsys):
    args = parser.parse_args(["--scheduler", "decode_first", "--host-kv-gb", "2.5",
                              "--host-kv-tokens", "1000", "--kv-cache-tokens", "4096"])
    kwargs = engine_kwargs(args, parser)
    assert (kwargs["scheduler"], kwargs["host_kv_gb"], kwargs["host_kv_tokens"],
            kwargs["kv_cache_tokens"]) == ("decode_first", 2.5, 1000, 4096)
    with pytest.raises(SystemExit) as info:
        engine_kwargs(parser.parse_args(["--scheduler", "fcfs"]), parser)
    assert info.value.code == 2
    assert "scheduler must be one of" in capsys.readouterr().err
    args = parser.parse_args(["--scheduler", "throttle", "--throttle-iterations", "4",
                              "--throttle-max-prefill", "512", "--throttle-min-prefill", "16",
                              "--throttle-kv-thresh", "0.1"])
    kwargs = engine_kwargs(args, parser)
    assert (kwargs["throttle_iterations"], kwargs["throttle_max_prefill"],
            kwargs["throttle_min_prefill"], kwargs["throttle_kv_thresh"]) == (4, 512, 16, 0.1)
    args = parser.parse_args(["--scheduler", "tdpipe", "--tdpipe-predictor", "oracle",
                              "--tdpipe-finish-ratio", "0.5"])
    kwargs = engine_kwargs(args, parser)
    assert (kwargs["tdpipe_predictor"], kwargs["tdpipe_finish_ratio"]) == ("oracle", 0.5)
    with pytest.raises(SystemExit):
        engine_kwargs(parser.parse_args(["--throttle-kv-thresh", "1.5"]), parser)
    assert "throttle_kv_thresh must be in [0, 1)" in capsys.readouterr().err
