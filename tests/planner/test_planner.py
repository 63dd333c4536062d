"""Layout enumeration, memory fit, the planner's choices on Fig. 13-like cases, workloads, CLI."""

from __future__ import annotations

import pytest

from jaxpipe.config.layout import Layout
from jaxpipe.config.meshes import load_mesh
from jaxpipe.model.presets import resolve_model
from jaxpipe.planner import choose_layouts, layout_name, make_workload, plan
from jaxpipe.planner import cli as plan_cli
from jaxpipe.planner.planner import candidate_layouts, feasible, paper_label
from jaxpipe.planner.workloads import constant, synthetic
from jaxpipe_bench.reproduce import submesh


@pytest.fixture(scope="module")
def llama70b():
    return resolve_model("llama2-70b").config


def test_candidates_are_every_pp_tp_factorisation():
    assert [layout_name(x) for x in candidate_layouts(8)] == ["pp8", "tp2pp4", "tp4pp2", "tp8"]
    assert [layout_name(x) for x in candidate_layouts(6)] == ["pp6", "tp2pp3", "tp3pp2", "tp6"]
    assert paper_label(Layout(pp=2, tp=4)) == "T4P2"


def test_memory_fit(llama70b):
    w = constant(4, 3000, 100)
    assert len(feasible(llama70b, load_mesh("a10x8-pcie"), w)) == 4
    with pytest.raises(ValueError, match="no \\(pp, tp\\) layout of 4 devices"):
        feasible(llama70b, submesh(load_mesh("a10x8-pcie"), 4), w)  # 138 GB > 4 x 24 GB


def test_fig13_like_choices(llama70b):
    mesh = load_mesh("a10x8-pcie")
    short = plan(llama70b, mesh, constant(256, 3000, 1))
    assert (short.prefill.name, short.decode.name, short.best_static.name) == ("pp8",) * 3
    mid = plan(llama70b, mesh, constant(256, 3000, 128))
    assert mid.best_static.name == "tp2pp4"
    long = plan(llama70b, mesh, constant(256, 3000, 1024))
    assert long.best_static.name == "tp4pp2"
    assert long.prefill.layout.pp == 8 and long.decode.layout.tp >= 4
    assert long.throughput > long.static_throughput


def test_choose_layouts_returns_layouts(llama70b):
    c_p, c_d = choose_layouts(llama70b, load_mesh("a10x8-pcie"), "sharegpt")
    assert isinstance(c_p, Layout) and isinstance(c_d, Layout)
    assert c_p.pp > c_d.pp and c_d.tp > c_p.tp  # pp-heavy prefill, tp-heavy decode


def test_workloads_match_reported_statistics_and_are_seeded():
    share = synthetic("sharegpt", 4000, seed=1)
    assert 140 < share.mean_prompt < 180 and 300 < share.mean_output < 370
    arxiv = synthetic("arxiv", 2000, seed=1)
    assert arxiv.mean_prompt > 2500 and 200 < arxiv.mean_output < 400 and arxiv.max_len <= 4096
    assert synthetic("arxiv", 50, seed=3) == synthetic("arxiv", 50, seed=3)
    assert make_workload("constant:30:4", 3).requests == ((30, 4),) * 3
    with pytest.raises(ValueError, match="accepted"):
        make_workload("alpaca")
    with pytest.raises(ValueError, match="constant:IN:OUT"):
        make_workload("constant:30")


def test_cli_prints_the_table_and_the_choice(capsys):
    plan_cli.main(["--model", "llama2-70b", "--mesh", "a10x8-pcie", "--workload", "sharegpt",
                   "--num-requests", "200"])
    out = capsys.readouterr().out
    for name in ("pp8", "tp2pp4", "tp4pp2", "tp8", "chosen: prefill", "best static"):
        assert name in out


@pytest.mark.parametrize("flags, message", [
    (["--workload", "nope"], "unknown workload 'nope'"),
    (["--workload", "constant:3000"], "bad workload 'constant:3000'"),
    (["--num-requests", "0"], "PlanConfig.num_requests must be an integer >= 1, got 0"),
    (["--host-kv-gb", "-1"], "PlanConfig.host_kv_gb must be a number >= 0, got -1.0"),
])
def test_cli_refuses_a_bad_flag_with_the_configs_message(flags, message, capsys):
    with pytest.raises(SystemExit) as info:
        plan_cli.main(flags)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_plans_a_model_given_by_its_weights(capsys):
    """The default model has no architecture table: the CLI reads the GGUF header, the same
    architecture the engine loads."""
    from jaxpipe.model import loading
    from jaxpipe.model.presets import resolve_model

    try:
        source = resolve_model("smollm2-135m")
    except (ValueError, FileNotFoundError) as err:
        pytest.skip(f"SmolLM2 weights unavailable: {err}")
    assert source.config is None and loading.source_config(source).num_layers == 30
    plan_cli.main(["--model", "smollm2-135m", "--mesh", "cpu-8", "--num-requests", "50"])
    assert "chosen: prefill" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="'no-such-model' is neither an existing path"):
        plan_cli.main(["--model", "no-such-model", "--mesh", "cpu-8"])
