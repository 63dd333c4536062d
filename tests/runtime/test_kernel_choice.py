"""The dispatcher's choices from injected timings (no clock involved), its cache, and a runner
built on a mixed choice: weights the kernel wins kept in panel order, the others natural, the
tokens those of XLA's dot everywhere."""

from __future__ import annotations

import pytest

from jaxpipe.kernels import int8_matmul, matmul
from jaxpipe.runtime import kernel_choice
from jaxpipe.runtime.kernel_choice import NATURAL_ORDER, PANEL_ORDER, XLA, KernelChoice, Matmul

WQ = Matmul("wq", 576, 576)


def timings(rows_to_seconds: dict[int, dict[str, float]]) -> dict[str, dict]:
    return {str(m): by_impl for m, by_impl in rows_to_seconds.items()}


def test_a_kernel_faster_at_most_row_counts_keeps_its_order_as_on_an_amx_xeon():
    # 2026-11-29's Xeon (model 207), w_gate_up 576x3072 gated, ms: the amx kernel wins at 1
    # to 128 and 512 rows (8.5x at 1), XLA's dot at 256 and 2048 (where it saves the most).
    seconds = {1: {XLA: 0.861, "amx": 0.101}, 8: {XLA: 0.882, "amx": 0.286},
               32: {XLA: 0.848, "amx": 0.237}, 64: {XLA: 1.560, "amx": 0.704},
               128: {XLA: 1.666, "amx": 1.576}, 256: {XLA: 1.998, "amx": 2.879},
               512: {XLA: 6.482, "amx": 5.124}, 2048: {XLA: 12.570, "amx": 17.664}}
    # Summed, natural is the lower (26.9 against 28.6 ms): the rule this replaces kept XLA's
    # order. Each count's factor behind the fastest: panel 1.44 * 1.41, natural far more.
    assert kernel_choice.choose_order(seconds) == PANEL_ORDER
    d = KernelChoice(timings={WQ.key(): timings(seconds)})
    assert [d.impl(WQ, m) for m in (1, 100, 200, 5000)] == ["amx"] * 4


def test_xla_faster_at_most_row_counts_keeps_the_natural_order():
    # The kernel 4x ahead at one row, XLA 2x ahead at the three others: factors behind the
    # fastest, natural 4, panel 2 * 2 * 2 = 8: natural, though panel has the lower sum (48 s, 59).
    seconds = {1: {XLA: 40.0, "avx512_bf16": 10.0}, 16: {XLA: 5.0, "avx512_bf16": 10.0},
               64: {XLA: 4.0, "avx512_bf16": 8.0}, 256: {XLA: 10.0, "avx512_bf16": 20.0}}
    assert kernel_choice.choose_order(seconds) == NATURAL_ORDER
    d = KernelChoice(timings={WQ.key(): timings(seconds)})
    assert [d.impl(WQ, m) for m in (1, 16, 200, 5000)] == [XLA] * 4


def test_each_row_count_takes_the_fastest_path_of_the_weights_order():
    seconds = {1: {XLA: 9.0, "portable": 2.0, "avx2": 3.0},
               8: {XLA: 9.0, "portable": 5.0, "avx2": 1.0},
               64: {XLA: 2.0, "portable": 9.0, "avx2": 4.0}}
    d = KernelChoice(timings={WQ.key(): timings(seconds)})
    assert d.order(WQ) == PANEL_ORDER  # panel 2x behind at 64 rows; natural 4.5x and 9x
    # XLA is fastest at 64 rows but reads the other order: the best panel path runs there.
    assert [d.impl(WQ, m) for m in (1, 2, 8, 9, 64, 4096)] == [
        "portable", "avx2", "avx2", "avx2", "avx2", "avx2"]


def test_a_step_takes_the_choice_of_the_nearest_measured_row_count_at_or_above():
    assert [kernel_choice.nearest_rows(m, (1, 8, 32)) for m in (1, 2, 8, 9, 32, 33, 999)] == [
        1, 8, 8, 32, 32, 32, 32]


def test_a_tie_keeps_natural_order():
    assert kernel_choice.choose_order({1: {XLA: 1.0, "avx2": 1.0}}) == NATURAL_ORDER


def test_forcing_one_implementation():
    d = KernelChoice(force=XLA, timings={})
    assert (d.order(WQ), d.impl(WQ, 64)) == (NATURAL_ORDER, XLA)
    built = {*kernel_choice.candidates(), *kernel_choice.candidates("int8"),
             *kernel_choice.candidates("q4_1")}
    missing = next((p for p in (*matmul.PATHS, *int8_matmul.PATHS) if p not in built),
                   "no_such_path")  # an AMX CPU builds every path
    with pytest.raises(ValueError, match=rf"matmul='{missing}' cannot run here; this machine "
                                         rf"has xla"):
        KernelChoice(force=missing, timings={})


def test_attention_takes_the_lower_total():
    case = kernel_choice.AttentionCase(9, 3, 64, rows=64, q_len=1, context=512)
    prefill = kernel_choice.AttentionCase(9, 3, 64, rows=1, q_len=256, context=0)
    d = KernelChoice(timings={f"{case.key()}:uint16": {"kernel": 1.0, XLA: 3.0},
                          f"{prefill.key()}:uint16": {"kernel": 2.0, XLA: 2.5}})
    assert d.attention([case, prefill], "uint16") == "kernel"  # 3 against 5.5
    d.timings[f"{prefill.key()}:uint16"] = {"kernel": 5.0, XLA: 0.5}
    assert d.attention([case, prefill], "uint16") == XLA  # 6 against 3.5


def test_experts_take_the_faster_dispatch_at_the_nearest_token_count():
    case = kernel_choice.ExpertsCase(experts=64, k=8, hidden=256, inter=512)
    by_tokens = {1: {"dense": 1.0, "grouped": 3.0}, 8: {"dense": 4.0, "grouped": 2.0},
                 256: {"dense": 9.0, "grouped": 1.0}}
    d = KernelChoice(timings={case.key(): timings(by_tokens)})
    assert [d.experts(case, t) for t in (1, 2, 8, 9, 4096)] == [
        "dense", "grouped", "grouped", "grouped", "grouped"]
    assert KernelChoice(force=XLA, timings={}).experts(case, 8) == "dense"


def test_timings_are_measured_once_and_cached_per_machine(tmp_path, monkeypatch):
    calls = []

    def fake_time(mm, rows, skip=frozenset()):
        calls.append((mm.key(), rows))
        return {XLA: 1.0 / rows, "avx2": 0.5 / rows}

    monkeypatch.setattr(kernel_choice, "time_matmul", fake_time)
    monkeypatch.setattr(kernel_choice.matmul, "paths", lambda: ("portable", "avx2"))
    cache = tmp_path / "kernel_choice.json"
    first = KernelChoice(cache=cache)
    assert first.order(WQ) == PANEL_ORDER and first.impl(WQ, 3) == "avx2"
    assert [rows for _, rows in calls] == list(kernel_choice.ROWS)
    again = KernelChoice(cache=cache)  # a new process on the same machine
    assert again.impl(WQ, 3) == "avx2" and len(calls) == len(kernel_choice.ROWS)
    head = Matmul("lm_head", 576, 49152)
    again.order(head)
    assert [rows for key, rows in calls if key == head.key()] == list(kernel_choice.HEAD_ROWS)


def test_the_cache_key_names_the_cpu_and_the_kernels():
    machine = kernel_choice.machine()
    assert set(machine) == {"cpu", "isa", "jaxlib", "flags", "kernels"}
    assert kernel_choice.cache_path().parent.name == "kernel_choice"


def test_the_table_names_every_candidate_and_the_choice():
    seconds = {1: {XLA: 2e-3, "avx2": 1e-3}, 64: {XLA: 1e-3, "avx2": 4e-3}}
    d = KernelChoice(timings={WQ.key(): timings(seconds)})
    records = d.rows([WQ])
    assert [(r["rows"], r["order"], r["chosen"]) for r in records] == [
        (1, NATURAL_ORDER, XLA), (64, NATURAL_ORDER, XLA)]
    assert records[0]["gflops"]["avx2"] == pytest.approx(2 * 576 * 576 / 1e-3 / 1e9)
    text = kernel_choice.format_table(records)
    assert "wq:576x576" in text and "avx2" in text and "natural" in text


def mixed_timings(cfg, kernel_wins: set[str], path: str) -> dict[str, dict]:
    """Injected timings for a model's matmuls on one device: the kernel path `path` wins
    for the weights named in `kernel_wins`, XLA for the others."""
    out = {}
    for mm in kernel_choice.model_matmuls(cfg):
        fast, slow = (path, XLA) if mm.name in kernel_wins else (XLA, path)
        rows = kernel_choice.HEAD_ROWS if mm.name == "lm_head" else kernel_choice.ROWS
        out[mm.key()] = timings({m: {fast: 1.0, slow: 2.0} for m in rows})
    return out


def test_a_mixed_choice_packs_only_the_kernels_weights_and_keeps_the_tokens(monkeypatch,
                                                                           tiny_smollm2_with):
    """A bf16 engine on injected timings where the kernel wins q, the gated MLP and the head
    and XLA the rest: those three (and only they) are kept in panel order, and the greedy
    tokens equal an engine on XLA's dot everywhere. The two-layer SmolLM2 of tests/conftest.py
    with an MLP PANEL wide (the gated kernel takes N a multiple of 2 * PANEL columns):
    every weight shape the 30-layer model has in kind, compiled in moments."""
    from jaxpipe import Engine, EngineConfig, SamplingParams
    from jaxpipe.kernels import matmul
    from jaxpipe.model.loading import source_config
    from jaxpipe.model.presets import resolve_model

    if not matmul.paths():
        pytest.skip("the bf16 kernel does not build here")
    model = tiny_smollm2_with(intermediate_size=matmul.PANEL)
    cfg = source_config(resolve_model(model))
    injected = KernelChoice(timings=mixed_timings(cfg, {"wq", "w_gate_up", "lm_head"},
                                              matmul.paths()[-1]))
    kwargs = dict(model=model, dtype="bfloat16", max_model_len=128, max_num_seqs=4, warmup=False,
                  show_progress=False)
    monkeypatch.setattr(kernel_choice, "for_machine", lambda force=None: injected)
    mixed = Engine(EngineConfig(**kwargs))
    place = mixed.runner.placements["decode"]
    assert set(place.packed) == {"wq", "w_gate_up"} and place.head_path is not None
    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = ["The capital of France is", "def fib(n):", "1, 2, 3,"]
    got = [o.outputs[0].token_ids for o in mixed.generate(prompts, params, use_tqdm=False)]
    mixed.close()
    monkeypatch.undo()
    xla = Engine(EngineConfig(**kwargs, matmul="xla"))
    assert not xla.runner.placements["decode"].packed
    want = [o.outputs[0].token_ids for o in xla.generate(prompts, params, use_tqdm=False)]
    xla.close()
    assert got == want


WQ8 = Matmul("wq", 576, 576, quant="int8")


def test_an_int8_weight_is_its_own_entry_measured_by_the_int8_timer(tmp_path, monkeypatch):
    """An int8 weight's candidates are XLA's int8 dot and the int8 kernel's paths, timed (by
    the int8 timer, at the same row counts as bf16) under a key of their own; the choice is
    the measurement's: the kernel where it is faster, XLA's order where that wins overall."""
    calls = []

    def fake_int8(mm, rows, skip=frozenset()):
        calls.append((mm.key(), rows))
        fast = "avx512_vnni" if rows <= 64 else "avx_vnni"
        return {XLA: 3.0, "avx2": 2.0, fast: 1.0, "portable": 9.0}

    def no_bf16(mm, rows, skip=frozenset()):
        raise AssertionError(f"the bf16 timer ran for {mm.key()}")

    monkeypatch.setattr(kernel_choice, "time_int8_matmul", fake_int8)
    monkeypatch.setattr(kernel_choice, "time_matmul", no_bf16)
    d = KernelChoice(cache=tmp_path / "kernel_choice.json")
    assert WQ8.key() == "wq:576x576:int8" != WQ.key()
    assert d.order(WQ8) == PANEL_ORDER
    assert [d.impl(WQ8, m) for m in (1, 64, 65, 4096)] == [
        "avx512_vnni", "avx512_vnni", "avx_vnni", "avx_vnni"]
    assert [rows for _, rows in calls] == list(kernel_choice.ROWS)
    head = Matmul("lm_head", 576, 49152, quant="int8")
    d.order(head)
    assert [rows for key, rows in calls if key == head.key()] == list(kernel_choice.HEAD_ROWS)


def test_int8_takes_xlas_int8_dot_where_it_wins_by_measurement():
    seconds = {1: {XLA: 1.0, "avx512_vnni": 2.0}, 256: {XLA: 1.0, "avx512_vnni": 3.0}}
    d = KernelChoice(timings={WQ8.key(): timings(seconds)})
    assert d.order(WQ8) == NATURAL_ORDER and d.impl(WQ8, 8) == XLA


def test_a_forced_path_applies_to_the_weights_whose_kernel_has_it(monkeypatch):
    """EngineConfig.matmul names one implementation: an int8 path forces int8 weights and
    leaves bf16 ones measured, a bf16 path the reverse, "xla" both."""
    monkeypatch.setattr(kernel_choice.int8_matmul, "paths", lambda: ("portable", "avx512_vnni"))
    monkeypatch.setattr(kernel_choice.matmul, "paths", lambda: ("portable", "avx512_bf16"))
    bf16 = {WQ.key(): timings({1: {XLA: 1.0, "avx512_bf16": 2.0}})}
    int8 = {WQ8.key(): timings({1: {XLA: 2.0, "avx512_vnni": 1.0}})}
    d = KernelChoice(force="avx512_vnni", timings={**bf16, **int8})
    assert (d.impl(WQ8, 1), d.impl(WQ, 1)) == ("avx512_vnni", XLA)
    d = KernelChoice(force="avx512_bf16", timings={**bf16, **int8})
    assert (d.impl(WQ8, 1), d.impl(WQ, 1)) == ("avx512_vnni", "avx512_bf16")
    d = KernelChoice(force=XLA, timings={})
    assert (d.impl(WQ8, 1), d.order(WQ8)) == (XLA, NATURAL_ORDER)
    quants = "none, int8, q8_0, q4_0, q4_1, q4_k, q6_k"
    with pytest.raises(ValueError, match=rf"Matmul.quant must be one of {quants}; got 'fp8'"):
        Matmul("wq", 576, 576, quant="fp8")


def test_int8_timer_times_every_int8_candidate():
    """The real timer on a tiny shape: one number per candidate (XLA's int8 dot and every
    int8 path this machine has), gated and not."""
    from jaxpipe.kernels import int8_matmul

    for mm in (Matmul("w", 8, 70, quant="int8"), Matmul("g", 8, 128, gated=True, quant="int8")):
        got = kernel_choice.time_int8_matmul(mm, 3)
        assert set(got) == {XLA, *int8_matmul.paths()}
        assert all(s > 0 for s in got.values())


WQ41 = Matmul("wq", 576, 576, quant="q4_1")


def test_a_gguf_weight_takes_the_fastest_candidate_at_each_row_count(tmp_path, monkeypatch):
    """A GGUF weight (its format as `quant`) is timed by the GGUF timer under a key of its
    own; XLA's reference and the kernel read the same blocks, so each row count takes its
    fastest candidate, XLA's included, with no order between them."""
    calls = []

    def fake_gguf(mm, rows, skip=frozenset()):
        calls.append((mm.key(), rows))
        return {XLA: 1.0 if rows >= 512 else 5.0, "avx2": 2.0, "avx512_vnni": 1.5}

    monkeypatch.setattr(kernel_choice, "time_gguf_matmul", fake_gguf)
    monkeypatch.setattr(kernel_choice, "time_int8_matmul", None)
    d = KernelChoice(cache=tmp_path / "kernel_choice.json")
    assert WQ41.key() == "wq:576x576:q4_1"
    assert d.order(WQ41) == NATURAL_ORDER
    assert [d.impl(WQ41, m) for m in (1, 256, 257, 512, 4096)] == [
        "avx512_vnni", "avx512_vnni", XLA, XLA, XLA]
    assert [rows for _, rows in calls] == list(kernel_choice.ROWS)


def test_gguf_candidates_are_xla_and_the_gguf_kernels_paths(monkeypatch):
    monkeypatch.setattr(kernel_choice.gguf_matmul, "paths", lambda: ("portable", "avx2"))
    assert kernel_choice.candidates("q8_0") == (XLA, "portable", "avx2")
    assert kernel_choice.order_of("avx2", "q4_1") == NATURAL_ORDER
    assert kernel_choice.order_of("avx2", "int8") == PANEL_ORDER


def test_gguf_timer_times_every_gguf_candidate():
    """The real timer on a tiny shape: one number per candidate (XLA's reference and every
    GGUF path this machine has), gated and not, for each format."""
    from jaxpipe.kernels import gguf_matmul

    for quant in ("q4_1", "q8_0", "q4_0", "q4_k", "q6_k"):
        k = 256 if quant.endswith("_k") else 64  # a multiple of the format's block
        for mm in (Matmul("w", k, 70, quant=quant), Matmul("g", k, 128, True, quant)):
            got = kernel_choice.time_gguf_matmul(mm, 3)
            assert set(got) == {XLA, *gguf_matmul.paths()}
            assert all(s > 0 for s in got.values())


def test_a_timing_inside_a_trace_is_refused():
    """Inside a jit being traced a timed call is only staged: the timing would measure the
    tracing (what made every GGUF path look equally fast when the step asked first)."""
    import jax
    import jax.numpy as jnp

    def traced(x):
        kernel_choice._seconds(jnp.sin, x)
        return x

    with pytest.raises(RuntimeError, match="inside a trace"):
        jax.jit(traced)(jnp.ones(3))


def test_gguf_weights_are_measured_when_the_layout_is_placed(monkeypatch):
    """`kernel_matmuls` (a layout's placement, before any step is traced) measures a GGUF
    weight's timings, as it measures the bf16 and int8 ones to choose their order."""
    from jaxpipe.runtime import pipeline

    monkeypatch.setattr(kernel_choice, "time_gguf_matmul",
                        lambda mm, rows, skip=frozenset(): {XLA: 2.0, "avx2": 1.0})
    d = KernelChoice(timings={})
    assert pipeline._in_stack(d, WQ41)
    assert WQ41.key() in d.timings


def test_a_candidate_far_behind_at_two_row_counts_is_not_timed_at_more(tmp_path, monkeypatch):
    """`beaten`: a candidate over PRUNE_FACTOR x the fastest at two row counts in a row is not
    timed at larger ones; one over it at a single count, or the fastest of its order, is."""
    asked = {}

    def fake_gguf(mm, rows, skip=frozenset()):
        asked[rows] = skip
        times = {XLA: 5e-4 + 1e-6 * rows, "avx512_vnni": 1e-5 * rows,
                 "avx2": 1.4e-5 * rows, "portable": 4e-4 * rows}  # portable: 40x
        return {impl: s for impl, s in times.items() if impl not in skip}

    monkeypatch.setattr(kernel_choice, "time_gguf_matmul", fake_gguf)
    d = KernelChoice(cache=tmp_path / "kernel_choice.json")
    d.order(WQ41)
    rows = kernel_choice.ROWS
    assert [("portable" in asked[m]) for m in rows] == [False, False, *[True] * (len(rows) - 2)]
    # XLA: 50x at 1 row, 6.4x at 8, then closer: never two counts in a row past 10x
    assert not any(XLA in skip or "avx2" in skip for skip in asked.values())
    assert "portable" not in d.timings[WQ41.key()]["64"]
    # XLA, 50x behind at 1 row, still timed at 2048 rows, where its fixed cost no longer counts
    assert d.impl(WQ41, 32) == "avx512_vnni" and d.impl(WQ41, 4096) == XLA


def test_beaten_keeps_each_orders_fastest():
    table = {"1": {XLA: 1.0, "avx2": 0.01, "portable": 0.5},
             "8": {XLA: 1.0, "avx2": 0.08, "portable": 4.0}}
    assert kernel_choice.beaten(table) == {"portable"}  # XLA: the natural order's fastest
    assert kernel_choice.beaten({"1": table["1"]}) == frozenset()  # one count is not enough
    table["32"] = {XLA: 1.0, "avx2": 0.32, "portable": 2.0}  # within 10x again
    assert kernel_choice.beaten(table) == frozenset()


def test_timing_inputs_are_seeded_normals_of_the_asked_dtype_and_scale():
    """The timers' random inputs (drawn a float32 chunk at a time, not as one float64 array):
    the dtype and shape asked for, mean 0 and standard deviation `scale`, each chunk its own
    draw, the same draw for the same seed and another for another seed."""
    import numpy as np

    x = kernel_choice._normal((3, 1001), "bfloat16", seed=5, scale=0.5, chunk=700)
    assert x.dtype == np.dtype("bfloat16") and x.shape == (3, 1001)
    v = np.asarray(x, np.float64)
    assert abs(v.mean()) < 0.03 and abs(v.std() - 0.5) < 0.02
    flat = v.reshape(-1)
    assert not np.array_equal(flat[:700], flat[700:1400])  # each chunk a new draw
    same = kernel_choice._normal((3, 1001), "bfloat16", seed=5, scale=0.5, chunk=700)
    assert np.array_equal(np.asarray(same), np.asarray(x))
    assert not np.array_equal(np.asarray(kernel_choice._normal((3, 1001), seed=6)),
                              np.asarray(kernel_choice._normal((3, 1001), seed=5)))
