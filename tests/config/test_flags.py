"""Flags derived from config dataclasses (jaxpipe/config/flags.py): every EngineConfig field has
a flag with its docstring text and default, values reach the config with the field's type, and
a value the config refuses is the parser's error naming it."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import pytest

from jaxpipe.config.engine import EngineConfig
from jaxpipe.config.flags import add_flags, config_from_args, config_kwargs, field_docs, flag_fields


@pytest.fixture
def parser():
    p = argparse.ArgumentParser()
    add_flags(p, EngineConfig)
    return p


@dataclass
class Toy:
    """A config of every kind of field.

    count: how many.
    ratio, name: a float and a text.
    mode: one of two.
    sizes: one or more.
    fast: a switch.
    port: None turns it off.
    out_path: flagged as --out.
    nested: no flag.
    """

    count: int = 3
    ratio: float | None = None
    name: str = "x"
    mode: Literal["a", "b"] = "a"
    sizes: tuple[int, ...] = (1, 2)
    fast: bool = False
    port: int | None = field(default=80, metadata={"none_flag": "--no-port"})
    out_path: str = field(default="o.json", metadata={"flags": ("--out", "-o")})
    nested: tuple[tuple[str, str], ...] = (("a", "b"),)

    def __post_init__(self):
        if self.count < 0:
            raise ValueError(f"Toy.count must be >= 0, got {self.count}")


def _toy(argv):
    p = argparse.ArgumentParser()
    add_flags(p, Toy)
    return config_from_args(Toy, p.parse_args(argv), p)


def test_every_field_kind_gets_its_flag():
    assert _toy([]) == Toy()
    assert _toy(["--count", "5", "--ratio", "0.5", "--name", "y", "--mode", "b",
                 "--sizes", "4,5", "6", "--fast", "--no-port", "-o", "p.json"]) == Toy(
        count=5, ratio=0.5, name="y", mode="b", sizes=(4, 5, 6), fast=True, port=None,
        out_path="p.json")
    assert _toy(["--no-port", "--port", "81"]).port == 81  # the last one given wins
    assert "nested" not in {f.name for f in flag_fields(Toy)}
    for bad in (["--mode", "c"], ["--count", "x"], ["--sizes", "1,x"], ["--nested", "a"],
                ["--out-path", "p"]):
        with pytest.raises(SystemExit):
            _toy(bad)


def test_a_refused_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        _toy(["--count", "-1"])
    assert info.value.code == 2 and "Toy.count must be >= 0" in capsys.readouterr().err


def test_help_is_the_docstring_entry_and_the_default():
    p = argparse.ArgumentParser()
    add_flags(p, Toy)
    text = " ".join(p.format_help().split())
    assert "a float and a text. (default: x)" in text
    assert "one or more. (default: 1,2)" in text and "a switch. (default: off)" in text
    assert field_docs(Toy)["ratio"] == field_docs(Toy)["name"] == "a float and a text."


def test_every_engine_field_has_a_documented_flag_with_its_default(parser):
    docs = field_docs(EngineConfig)
    options = {a.dest: a for a in parser._actions}
    default = EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        assert len(docs.get(f.name, "")) > 20, f"EngineConfig.{f.name} has no doc entry"
        action = options[f.name]
        assert action.option_strings[0] == "--" + f.name.replace("_", "-")
        assert docs[f.name].split()[0] in action.help
        if f.default is not None and f.default is not dataclasses.MISSING:
            shown = ("on" if f.default else "off") if isinstance(f.default, bool) else f.default
            assert f"(default: {shown})" in action.help, f.name
    assert config_from_args(EngineConfig, parser.parse_args([]), parser) == default


def test_values_reach_the_config_with_the_fields_types(parser):
    args = parser.parse_args(["--max-num-seqs", "12", "--memory-utilization", "0.25",
                              "--no-overlap", "--prefill", "pp=1", "--no-warmup"])
    kwargs = config_kwargs(EngineConfig, args)
    assert kwargs == {"max_num_seqs": 12, "memory_utilization": 0.25, "overlap": False,
                      "prefill": "pp=1", "warmup": False}
    config = config_from_args(EngineConfig, args, parser)
    assert (config.max_num_seqs, config.overlap, config.prefill.pp) == (12, False, 1)
    assert config_kwargs(EngineConfig, parser.parse_args([])) == {}  # its defaults apply
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-num-seqs", "many"])
    kv = config_from_args(EngineConfig, parser.parse_args(["--kv-cache-dtype", "int8"]), parser)
    assert kv.kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp8"])


def test_scheduler_flags_reach_engine_config(parser, capsys):
    args = parser.parse_args(["--scheduler", "decode_first", "--host-kv-gb", "2.5",
                              "--host-kv-tokens", "1000", "--kv-cache-tokens", "4096"])
    kwargs = config_kwargs(EngineConfig, args)
    assert (kwargs["scheduler"], kwargs["host_kv_gb"], kwargs["host_kv_tokens"],
            kwargs["kv_cache_tokens"]) == ("decode_first", 2.5, 1000, 4096)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--scheduler", "fcfs"])
    assert info.value.code == 2
    assert "argument --scheduler: invalid choice: 'fcfs'" in capsys.readouterr().err
    args = parser.parse_args(["--scheduler", "throttle", "--throttle-iterations", "4",
                              "--throttle-max-prefill", "512", "--throttle-min-prefill", "16",
                              "--throttle-kv-thresh", "0.1"])
    kwargs = config_kwargs(EngineConfig, args)
    assert (kwargs["throttle_iterations"], kwargs["throttle_max_prefill"],
            kwargs["throttle_min_prefill"], kwargs["throttle_kv_thresh"]) == (4, 512, 16, 0.1)
    args = parser.parse_args(["--scheduler", "tdpipe", "--tdpipe-predictor", "oracle",
                              "--tdpipe-finish-ratio", "0.5"])
    kwargs = config_kwargs(EngineConfig, args)
    assert (kwargs["tdpipe_predictor"], kwargs["tdpipe_finish_ratio"]) == ("oracle", 0.5)
    with pytest.raises(SystemExit):
        config_from_args(EngineConfig, parser.parse_args(["--throttle-kv-thresh", "1.5"]), parser)
    assert "throttle_kv_thresh must be in [0, 1)" in capsys.readouterr().err


def test_fixed_choice_fields_list_the_choices_their_validation_accepts(parser, capsys):
    from jaxpipe.config import engine, model

    options = {a.dest: a for a in parser._actions}
    for name, accepted in [("dtype", model.DTYPES), ("attention", engine.ATTENTION),
                           ("matmul", engine.MATMULS), ("scheduler", engine.SCHEDULERS),
                           ("tdpipe_predictor", engine.PREDICTORS), ("sampler", engine.SAMPLERS)]:
        assert tuple(options[name].choices) == accepted, name
        flag = "--" + name.replace("_", "-")
        assert "{" + ",".join(accepted) + "}" in parser.format_help(), name
        with pytest.raises(SystemExit):
            parser.parse_args([flag, "nope"])
        assert f"argument {flag}: invalid choice: 'nope'" in capsys.readouterr().err
        with pytest.raises(ValueError, match=f"EngineConfig.{name} must be one of"):
            EngineConfig(**{name: "nope"}, warmup=False)  # Python callers: the class's message


@dataclass(frozen=True)
class Command:
    """A command's arguments: positionals and a tuple of choices.

    source: where from (positional, required).
    level: how much (positional, optional).
    kind: a positional choice.
    rest: the remaining arguments, verbatim.
    tables: one or more tables.
    out_path: where the output goes.
    """

    source: str = field(metadata={"positional": True})
    level: int = field(default=1, metadata={"positional": True})
    kind: Literal["a", "b"] = field(default="a", metadata={"positional": True})
    rest: tuple[str, ...] = field(default=(), metadata={"positional": True})
    tables: tuple[Literal["identity", "shuffled"], ...] = ("shuffled",)
    out_path: str = field(default="o.json", metadata={"flags": ("--out",)})


def _command(argv, **defaults):
    p = argparse.ArgumentParser()
    add_flags(p, Command, defaults=defaults)
    return config_from_args(Command, p.parse_args(argv), p)


def test_positional_fields_are_positional_arguments(capsys):
    assert _command(["src"]) == Command("src")
    assert _command(["--tables=identity", "src", "3", "b", "--", "--x", "a,b"]) == Command(
        "src", 3, "b", ("--x", "a,b"), ("identity",))  # the rest verbatim: not split on commas
    for bad in ([], ["src", "x"], ["src", "1", "c"]):
        with pytest.raises(SystemExit):
            _command(bad)
    assert "invalid choice: 'c' (choose from 'a', 'b')" in capsys.readouterr().err
    p = argparse.ArgumentParser()
    add_flags(p, Command)
    usage = " ".join(p.format_usage().split())
    assert "source [level] [{a,b}] [rest ...]" in usage


def test_a_tuple_of_literals_takes_its_values_only(capsys):
    assert _command(["s", "--tables", "identity,shuffled"]).tables == ("identity", "shuffled")
    assert _command(["s", "--tables", "shuffled", "identity"]).tables == ("shuffled", "identity")
    with pytest.raises(SystemExit):
        _command(["s", "--tables", "identity,random"])
    assert ("argument --tables: invalid choice: 'random' (choose from 'identity', 'shuffled')"
            in capsys.readouterr().err)
    p = argparse.ArgumentParser()
    add_flags(p, Command)
    assert "--tables {identity,shuffled}" in p.format_help()


def test_a_command_line_default_replaces_the_field_default_in_value_and_help():
    assert _command(["s"], out_path="x.json").out_path == "x.json"
    assert _command(["s", "--out", "y.json"], out_path="x.json").out_path == "y.json"
    assert _command(["s"], level=5).level == 5
    p = argparse.ArgumentParser()
    add_flags(p, Command, defaults={"out_path": "x.json"})
    assert "where the output goes. (default: x.json)" in " ".join(p.format_help().split())
    with pytest.raises(TypeError, match="defaults for no flag: \\['nope'\\]"):
        add_flags(argparse.ArgumentParser(), Command, defaults={"nope": 1})
    with pytest.raises(TypeError, match="defaults for no flag"):  # a skipped field has no flag
        add_flags(argparse.ArgumentParser(), Command, skip=("out_path",),
                  defaults={"out_path": "x"})


@dataclass
class Repeats:
    """A field whose flag is given once per value.

    items: KEY=VALUE, repeated.
    """

    items: tuple[str, ...] = field(default=(), metadata={"flags": ("--item",), "repeat": True})


def test_a_repeated_flag_keeps_each_value_whole_commas_included():
    def parse(argv):
        p = argparse.ArgumentParser()
        add_flags(p, Repeats)
        return config_from_args(Repeats, p.parse_args(argv), p)

    assert parse([]).items == ()
    assert parse(["--item", "a=1,2", "--item", "b=x"]).items == ("a=1,2", "b=x")
    assert parse(["--item=c"]).items == ("c",)
