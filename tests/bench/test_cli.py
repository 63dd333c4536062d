"""Benchmark flags come from the bench config dataclasses (jaxpipe_bench/cli.py over
jaxpipe.config_flags)."""

import pytest

from jaxpipe.config_flags import config_from_args
from jaxpipe_bench import cli
from jaxpipe_bench.layouts import LayoutBenchConfig


def _config(argv):
    p = cli.parser("", LayoutBenchConfig, "out/x.json")
    return config_from_args(LayoutBenchConfig, p.parse_args(argv), p)


def test_no_flags_give_the_config_defaults():
    assert _config([]) == LayoutBenchConfig()


def test_flags_reach_the_config():
    cfg = _config(["--stages", "1", "2", "--context", "512", "--dtype", "float32"])
    assert cfg.stages == (1, 2) and cfg.context == 512 and cfg.dtype == "float32"
    assert _config(["--stages", "1,2,4"]).stages == (1, 2, 4)


def test_nested_tuple_fields_are_not_flags():
    with pytest.raises(SystemExit):
        _config(["--pairs", "x"])
    assert _config([]).pairs == LayoutBenchConfig().pairs


def test_dtype_is_checked():
    with pytest.raises(SystemExit):
        _config(["--dtype", "int8"])
