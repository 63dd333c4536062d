"""Benchmark flags come from the bench config dataclasses (jaxpipe/bench/cli.py)."""

import pytest

from jaxpipe.bench import cli
from jaxpipe.bench.decode_pipeline import DecodeBenchConfig
from jaxpipe.bench.layouts import LayoutBenchConfig


@pytest.mark.parametrize("config_cls", [DecodeBenchConfig, LayoutBenchConfig])
def test_no_flags_give_the_config_defaults(config_cls):
    args = cli.parser("", config_cls, "out/x.json").parse_args([])
    assert cli.config_from(args, config_cls) == config_cls()


def test_flags_reach_the_config():
    p = cli.parser("", DecodeBenchConfig, "out/x.json")
    args = p.parse_args(["--steps", "1", "2", "--layouts", "pp=8", "--max-len", "512",
                         "--dtype", "float32"])
    cfg = cli.config_from(args, DecodeBenchConfig)
    assert cfg.steps == (1, 2) and cfg.layouts == ("pp=8",)
    assert cfg.max_len == 512 and cfg.dtype == "float32"


def test_nested_tuple_fields_are_not_flags():
    p = cli.parser("", LayoutBenchConfig, "out/x.json")
    with pytest.raises(SystemExit):
        p.parse_args(["--pairs", "x"])
    assert cli.config_from(p.parse_args([]), LayoutBenchConfig).pairs == LayoutBenchConfig().pairs


def test_dtype_is_checked():
    with pytest.raises(SystemExit):
        cli.parser("", DecodeBenchConfig, "out/x.json").parse_args(["--dtype", "int8"])
