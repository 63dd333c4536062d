"""`python -m jaxpipe.serve`'s flags: one per ServerConfig and EngineConfig field
(jaxpipe.config.flags), with the field's default, and the spellings the README uses."""

from __future__ import annotations

import dataclasses

import pytest

from jaxpipe.serve.__main__ import parse_args
from jaxpipe.serve.config import ServerConfig


def test_no_flags_give_the_config_defaults():
    config, level = parse_args([])
    assert config == ServerConfig() and level == "INFO"


def test_every_server_field_has_a_flag_that_reaches_the_config():
    given = {"host": "0.0.0.0", "port": 50052, "http_host": "::1", "http_port": 8001,
             "max_message_mb": 32.0, "max_request_bytes": 4096, "max_concurrent_requests": 7,
             "drain_timeout": 5.0, "engine_restarts": 2, "restart_backoff": 0.5,
             "metrics_port": 9100, "metrics_host": "0.0.0.0", "batch_dir": "/tmp/b",
             "max_file_mb": 8.0, "tool_call_parser": "llama3_json"}
    names = {f.name for f in dataclasses.fields(ServerConfig)} - {"engine"}
    assert set(given) == names  # a new field gets a case here
    argv = [a for name, value in given.items()
            for a in ("--" + name.replace("_", "-"), str(value))]
    config, _ = parse_args([*argv, "--max-num-seqs", "3", "--no-overlap"])
    assert config == ServerConfig(**given, engine={"max_num_seqs": 3, "overlap": False})


def test_front_ends_turn_off():
    config, _ = parse_args(["--no-grpc", "--http-port", "0"])
    assert (config.port, config.http_port) == (None, 0)
    config, _ = parse_args(["--no-http", "--log-level", "DEBUG"])
    assert config.http_port is None and config.port == ServerConfig().port


def test_refused_values_are_usage_errors(capsys):
    for argv, message in ((["--no-grpc", "--no-http"], "both None"),
                          (["--no-http", "--batch-dir", "x"], "batch_dir needs"),
                          (["--port", "70000"], "port must be an integer"),
                          (["--tool-call-parser", "xml"], "tool_call_parser must be one of"),
                          (["--max-num-seqs", "0"], "max_num_seqs must be")):
        with pytest.raises(SystemExit) as info:
            parse_args(argv)
        assert info.value.code == 2 and message in capsys.readouterr().err
