"""Benchmark flags come from the bench config dataclasses (jaxpipe_bench/cli.py)."""

import pytest

from jaxpipe_bench import cli
from jaxpipe_bench.layouts import LayoutBenchConfig


def test_no_flags_give_the_config_defaults():
    args = cli.parser("", LayoutBenchConfig, "out/x.json").parse_args([])
    assert cli.config_from(args, LayoutBenchConfig) == LayoutBenchConfig()


def test_flags_reach_the_config():
    p = cli.parser("", LayoutBenchConfig, "out/x.json")
    args = p.parse_args(["--stages", "1", "2", "--context", "512", "--dtype", "float32"])
    cfg = cli.config_from(args, LayoutBenchConfig)
    assert cfg.stages == (1, 2) and cfg.context == 512 and cfg.dtype == "float32"


def test_nested_tuple_fields_are_not_flags():
    p = cli.parser("", LayoutBenchConfig, "out/x.json")
    with pytest.raises(SystemExit):
        p.parse_args(["--pairs", "x"])
    assert cli.config_from(p.parse_args([]), LayoutBenchConfig).pairs == LayoutBenchConfig().pairs


def test_dtype_is_checked():
    with pytest.raises(SystemExit):
        cli.parser("", LayoutBenchConfig, "out/x.json").parse_args(["--dtype", "int8"])
