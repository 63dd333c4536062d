"""Sliding windows, logit soft-capping and the score scale on every ragged-span attention
implementation (the C++ CPU kernel "cpu", the Pallas kernel in interpret mode
"pallas-interpret", the XLA path "xla") against the float64 NumPy reference
(attention_cases.numpy_attention), with the window traced; the read bound of the kernels
(blocks wholly before a tile's earliest window start are never read); and the same options in
`attention_math.causal_attention`, the whole-sequence reference."""

from __future__ import annotations

import functools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpipe.kernels import attention_math
from jaxpipe.kernels import ragged_attention as ra
from jaxpipe.kernels.paged import to_storage
from kernel_tests.attention_cases import (
    BS,
    CAP,
    IMPLS,
    KV_LEN,
    NB,
    Q_LEN,
    Q_START,
    UNCOVERED,
    R,
    T,
    close,
    f64,
    i32,
    inputs,
    shuffled_table,
    want,
    xla,
)

KERNELS = ["cpu", "pallas-interpret"]  # those that skip blocks before the window

# Spans whose windows start deep in their rows (tokens 0..29): decode at the last position
# (row 0), a prefill chunk of 4 at the end (row 1), a chunk of 20 (two of the kernels' tiles,
# row 2), decode mid-row (row 3), an idle row and short rows near the start.
W_Q_LEN = [1, 4, 20, 1, 0, 1, 3]
W_KV_LEN = [CAP, CAP, 38, 23, 5, 7, 12]
W_Q_START = [0, 1, 5, 25, 30, 26, 27]
W_T = 30


@pytest.fixture(params=list(IMPLS))
def impl(request):
    """The name of one implementation (the C++ kernel skipped where it cannot be built)."""
    if request.param == "cpu" and not ra.available():
        pytest.skip("the C++ kernel cannot be built here")
    return request.param


@functools.cache
def jitted(name, softcap, scale, path=None):
    """One implementation under jit, softcap and scale (and the C++ kernel's path) static:
    compiled once per shape, then run for every window, table and span (all traced)."""
    return jax.jit(partial(IMPLS[name], softcap=softcap, scale=scale,
                           **({"path": path} if path else {})))


def run(name, q, k, v, table, q_start=Q_START, q_len=Q_LEN, kv_len=KV_LEN, layer=0, window=0,
        softcap=0.0, scale=None, path=None):
    """One implementation under jit: spans, table, layer and window traced; softcap, scale and
    path (the C++ kernel's; None: its default) static."""
    fn = jitted(name, softcap, scale, path)
    return np.asarray(fn(q, k, v, *i32(table, q_start, q_len, kv_len), jnp.int32(layer),
                         window=jnp.int32(window)))


@pytest.mark.parametrize("window", [1, 3, 5, 7, 13, CAP, 1000])
def test_windows_match_numpy(impl, window):
    """Windows of one key, inside one block (3 < BS = 5), of exactly a block, starting
    mid-block (7, 13), and as long as the row or longer (no window). The spans of 13, 29 and
    40 queries straddle window edges inside one tile (each query its own start)."""
    q, k, v = inputs(jnp.float32, seed=21)
    table = shuffled_table(seed=21)
    got = run(impl, q, k, v, table, window=window)
    close(got, want(q, k, v, table, window=window))
    assert not got[UNCOVERED].any()
    full = want(q, k, v, table)
    if window >= CAP:
        close(got, full)
    else:
        assert not np.allclose(got, full, atol=1e-3)


@pytest.mark.parametrize("window", [4, 10])
def test_long_spans_straddle_window_edges(impl, window):
    """A span of 37 queries (three of the Pallas kernel's tiles), one of 16, short ones."""
    q, k, v = inputs(jnp.float32, seed=12, tokens=40 + 17)
    table = shuffled_table(seed=12)
    spans = dict(q_start=[0, 37, 56, 40, 56, 56, 56], q_len=[37, 3, 1, 16, 0, 0, 0],
                 kv_len=[39, 3, 40, 17, 1, 1, 1])
    close(run(impl, q, k, v, table, **spans, window=window),
          want(q, k, v, table, **spans, window=window))


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(16, 6, 2), (64, 9, 3)])
def test_decode_rows_with_windows(impl, head_dim, heads, kv_heads):
    """One query per row (GQA), windows starting mid-block, at a block edge, and longer than
    the row."""
    q, k, v = inputs(jnp.float32, seed=2, tokens=R, head_dim=head_dim, heads=heads,
                     kv_heads=kv_heads)
    table = shuffled_table(seed=2)
    spans = dict(q_start=list(range(R))[::-1], q_len=[1, 1, 1, 0, 1, 1, 1],
                 kv_len=[1, CAP, 6, 9, 10, 23, 37])
    for window in (3, 5, 12):
        close(run(impl, q, k, v, table, **spans, window=window),
              want(q, k, v, table, **spans, window=window))


@pytest.mark.parametrize("softcap,scale", [(0.0, 0.3), (1.5, None), (2.0, 0.7)])
@pytest.mark.parametrize("window", [0, 7])
def test_softcap_and_scale(impl, softcap, scale, window):
    """Soft-capping on and off and a scale that is not 1 / sqrt(D), with and without a
    window; both change the result."""
    q, k, v = inputs(jnp.float32, seed=23)
    table = shuffled_table(seed=23)
    got = run(impl, q, k, v, table, window=window, softcap=softcap, scale=scale)
    close(got, want(q, k, v, table, window=window, softcap=softcap, scale=scale))
    assert not np.allclose(got, want(q, k, v, table, window=window), atol=1e-3)


@pytest.mark.parametrize("storage", [jnp.uint16, jnp.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 8, 2), (16, 6, 2)])
def test_bf16_pools(impl, storage, head_dim, heads, kv_heads):
    """bf16 pools (the C++ kernel's AVX2 decode path at head dims 64 and 128, its avx512_bf16
    paths' fallback with a window), window 7 with and without softcap and scale: to bf16
    rounding of the exact result, and close to the XLA path (same roundings)."""
    q, k, v = inputs(storage, seed=24, head_dim=head_dim, heads=heads, kv_heads=kv_heads)
    table = shuffled_table(seed=24)
    for options in (dict(window=7), dict(window=7, softcap=2.0, scale=0.2)):
        got = run(impl, q, k, v, table, **options)
        np.testing.assert_allclose(got, want(q, k, v, table, **options), atol=3e-2)
        if impl != "xla":
            np.testing.assert_allclose(got, xla(q, k, v, table, **options), atol=1e-2)


@pytest.mark.parametrize("storage", [jnp.float32, jnp.uint16])
def test_scan_over_layers_with_a_window_each(impl, storage):
    """The engine's use: one `lax.scan` over the stacked pool, layer and window both scan
    inputs (traced), a different window per layer (none, 3, 8)."""
    q, k, v = inputs(storage, seed=25, layers=3, head_dim=64, heads=9, kv_heads=3)
    table = shuffled_table(seed=25)
    spans = i32(table, Q_START, Q_LEN, KV_LEN)
    windows = [0, 3, 8]
    fn = IMPLS[impl]

    @jax.jit
    def all_layers(k, v, windows):
        def body(carry, xs):
            layer, window = xs
            return carry, fn(q, k, v, *spans, layer, window=window, softcap=3.0)

        return jax.lax.scan(body, 0, (jnp.arange(3), windows))[1]  # [L, T, H, D]

    got = np.asarray(all_layers(k, v, jnp.asarray(windows, jnp.int32)))
    tol = 2e-5 if storage == jnp.float32 else 3e-2
    for i, window in enumerate(windows):
        np.testing.assert_allclose(got[i], want(q, k, v, table, layer=i, window=window,
                                                softcap=3.0), atol=tol, rtol=tol)


def test_out_of_range_table_entries_with_a_window(impl):
    """A query needs only its window's blocks. Row 4 (positions 6..34, tokens 1..29), window
    7, block 3 (positions 15..19) out of range: queries whose window holds it stop before it
    (p 15..20), or see nothing when it holds their window's start (p 21..25); later ones
    (p >= 26) see their whole window, though a tile of the kernels spans the bad block. Row 3
    (positions 18..30), block 0 out of range: before every window, changes nothing."""
    q, k, v = inputs(jnp.float32, seed=26)
    table = shuffled_table(seed=26)
    clean = run(impl, q, k, v, table, window=7)
    bad = table.copy()
    bad[4, 3], bad[3, 0] = NB, -1
    got = run(impl, q, k, v, bad, window=7)
    close(got, want(q, k, v, bad, window=7))
    tokens = {p: 1 + p - 6 for p in range(6, 35)}  # row 4: position -> token
    assert not got[[tokens[p] for p in range(21, 26)]].any()
    np.testing.assert_array_equal(got[[tokens[p] for p in range(26, 35)]],
                                  clean[[tokens[p] for p in range(26, 35)]])
    np.testing.assert_array_equal(got[74:87], clean[74:87])  # row 3


def blocks_before_windows(table, window):
    """The pool blocks (W_ spans) wholly before the window of their row's first query, and
    the positions before it in the block where it starts: (blocks, [(block, offset)])."""
    blocks, partial_block = [], []
    for r, (n, kv) in enumerate(zip(W_Q_LEN, W_KV_LEN, strict=True)):
        if n <= 0:
            continue
        lo = max(0, kv - n - window + 1)
        blocks += [table[r, j] for j in range(lo // BS)]
        partial_block += [(table[r, lo // BS], o) for o in range(lo % BS)]
    return blocks, partial_block


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("storage,head_dim", [(jnp.float32, 16), (jnp.uint16, 64),
                                              (jnp.float32, 64)])
@pytest.mark.parametrize("window", [1, 6])
def test_blocks_before_the_window_are_never_read(name, storage, head_dim, window):
    """K/V blocks wholly before a row's first window start hold NaN: the kernels never read
    them (a long context costs the window), so the outputs stay finite and exact. Keys before
    the window inside the block where it starts are read but masked (large values there
    change nothing). The XLA path masks instead of skipping, so it is not asked this."""
    if name == "cpu" and not ra.available():
        pytest.skip("the C++ kernel cannot be built here")
    q, k, v = inputs(storage, seed=27, tokens=W_T, head_dim=head_dim, heads=9, kv_heads=3)
    table = shuffled_table(seed=27)
    spans = dict(q_start=W_Q_START, q_len=W_Q_LEN, kv_len=W_KV_LEN)
    expected = want(q, k, v, table, **spans, window=window)
    blocks, partial_block = blocks_before_windows(table, window)
    assert len(blocks) >= 10
    k2, v2 = (np.array(f64(x)[0], np.float32) for x in (k, v))
    k2[0, blocks], v2[0, blocks] = np.nan, np.nan
    for block, offset in partial_block:
        k2[0, block, :, offset], v2[0, block, :, offset] = 1e4, -1e4
    store = jnp.zeros((1,), storage)
    k2, v2 = (to_storage(jnp.asarray(x), store) for x in (k2, v2))
    got = run(name, q, k2, v2, table, **spans, window=window)
    assert np.isfinite(got).all()
    tol = 2e-5 if storage == jnp.float32 else 3e-2
    np.testing.assert_allclose(got, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("storage", [jnp.float32, jnp.uint16])
def test_write_and_attend_with_options(storage):
    """The C++ kernel's fused write-then-attend with a window, softcap and scale, against its
    jnp twin and the float64 reference over the pool it wrote."""
    if not ra.available():
        pytest.skip("the C++ kernel cannot be built here")
    _, k, v = inputs(storage, seed=28, head_dim=64, heads=9, kv_heads=3, layers=2)
    rng = np.random.default_rng(28)
    q = jnp.asarray(rng.normal(size=(97, 9, 64)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(97, 2, 3, 64)), jnp.float32)
    angles = rng.uniform(-7, 7, size=(97, 32))
    cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
    table = shuffled_table(seed=28)
    args = (q, kv, cos, sin, k, v, *i32(table, Q_START, Q_LEN, KV_LEN), jnp.int32(1))
    options = dict(softcap=2.5, scale=0.2)
    out, k2, v2 = jax.jit(partial(ra.write_and_attend, **options))(*args, window=jnp.int32(7))
    ref, _, _ = jax.jit(partial(ra.write_and_attend_reference, **options))(
        *args, window=jnp.int32(7))
    bf16 = storage != jnp.float32
    close(np.asarray(out), np.asarray(ref), tol=1e-2 if bf16 else 2e-5)
    half = q.shape[-1] // 2
    c, s = np.asarray(cos, np.float64)[:, None], np.asarray(sin, np.float64)[:, None]
    qd = np.asarray(q, np.float64)
    rot_q = np.concatenate([qd[..., :half] * c - qd[..., half:] * s,
                            qd[..., half:] * c + qd[..., :half] * s], -1)
    exact = want(jnp.asarray(rot_q, jnp.float32), k2, v2, table, layer=1, window=7, **options)
    np.testing.assert_allclose(np.asarray(out), exact, atol=3e-2 if bf16 else 2e-5)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan")])
def test_bad_scale_is_named(scale):
    q, k, v = inputs(jnp.float32)
    spans = i32(shuffled_table(), Q_START, Q_LEN, KV_LEN)
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        ra.ragged_attention(q, k, v, *spans, scale=scale)


@pytest.mark.parametrize("window", [0, 1, 6, 100])
def test_causal_attention_options(window):
    """`attention_math.causal_attention` (Decoder.forward's) with a window (static, and traced
    under jit), softcap and scale, against float64 NumPy, query by query; chunks of 16 split
    the 37 queries."""
    rng = np.random.default_rng(29)
    q, k, v = (rng.normal(size=(2, 37, n, 16)).astype(np.float32) for n in (6, 2, 2))
    options = dict(softcap=1.5, scale=0.3)
    exact = np.zeros(q.shape)
    for b in range(2):
        for t in range(37):
            lo = max(0, t - window + 1) if window > 0 else 0
            for h in range(6):
                s = k[b, lo:t + 1, h // 3].astype(np.float64) @ q[b, t, h] * 0.3
                e = np.exp(1.5 * np.tanh(s / 1.5) - 1.5)
                exact[b, t, h] = (e / e.sum()) @ v[b, lo:t + 1, h // 3]
    static = attention_math.causal_attention(q, k, v, 16, window=window, **options)
    traced = jax.jit(partial(attention_math.causal_attention, chunk=16, **options))(
        q, k, v, window=jnp.int32(window))
    close(np.asarray(static), exact)
    close(np.asarray(traced), exact)


# ---- each path of the C++ kernel, asked for by name (`attention_path`) -----------------------

# GQA groups of 5, 7, 13, 1 and 2 at the head dims the avx paths take (256: Gemma 2 2B's
# 8 / 4 heads); 13 * 16 query vectors fill the avx512_bf16 tiles' 48-vector passes, then one
# of 16.
PATH_DIMS = [(64, 10, 2), (128, 7, 1), (64, 39, 3), (128, 3, 3), (256, 8, 4)]
# A pool at the engine's block size (16) with rows longer than a tile: decode at the end of a
# full row (row 0) and mid-row (row 1), a chunk of 37 queries after 60 keys (row 2: three
# tiles), a chunk of 16 at the end of a full row (row 3), a whole 50-token prompt (row 4), an
# idle row (5). Rows use 48 of the 53 blocks; NaN fills the rest where asked.
L_BS, L_MB, L_NB = 16, 8, 53
L_Q_LEN = [1, 1, 37, 16, 50, 0]
L_KV_LEN = [L_BS * L_MB, 70, 97, 128, 50, 9]
L_Q_START = [104, 0, 1, 38, 54, 0]
L_T = 105
L_SPANS = dict(q_start=L_Q_START, q_len=L_Q_LEN, kv_len=L_KV_LEN)


def skip_unless_taken(path, storage, head_dim):
    if not ra.takes(path, storage, head_dim):
        pytest.skip(f"the {path} path does not take {jnp.dtype(storage)} pools of head dim "
                    f"{head_dim}")


def tolerances(storage):
    """(against float64, against the XLA path): bf16 pools round q and the probabilities to
    bf16 as the XLA path does (a probability on the other side of a rounding boundary: ~3e-3
    on these values)."""
    return (2e-5, 2e-5) if storage == jnp.float32 else (3e-2, 5e-3)


def long_inputs(storage, head_dim, heads, kv_heads, seed):
    """q [L_T, H, D] f32, k, v [1, L_NB, Hkv, L_BS, D] in `storage`, table [6, L_MB] over
    all but 5 blocks, and those 5 unused blocks."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(L_T, heads, head_dim)).astype(np.float32)
    k, v = (rng.normal(size=(1, L_NB, kv_heads, L_BS, head_dim)).astype(np.float32)
            for _ in range(2))
    perm = rng.permutation(L_NB).astype(np.int32)
    store = jnp.zeros((1,), storage)
    table = perm[:6 * L_MB].reshape(6, L_MB)
    return (jnp.asarray(q), to_storage(jnp.asarray(k), store), to_storage(jnp.asarray(v), store),
            table, perm[6 * L_MB:])


@functools.cache
def case_inputs(case: tuple) -> tuple:
    """(q, k, v, table, spans) of a windows case (kind, storage, head_dim, heads, kv_heads):
    "short" the shared cases (BS = 5), "long" block size 16 on rows of up to 128 keys.
    Made once per case, for every path."""
    kind, storage, head_dim, heads, kv_heads = case
    if kind == "short":
        q, k, v = inputs(storage, seed=31, head_dim=head_dim, heads=heads, kv_heads=kv_heads)
        return q, k, v, shuffled_table(seed=31), dict(q_start=Q_START, q_len=Q_LEN,
                                                      kv_len=KV_LEN)
    q, k, v, table, _ = long_inputs(storage, head_dim, heads, kv_heads, seed=32)
    return q, k, v, table, L_SPANS


@functools.cache
def window_references(case: tuple, windows: tuple) -> dict:
    """softcap -> (the float64 result without a window, {window: (float64 NumPy's, the XLA
    path's)}) for a windows case: the same for every kernel path, so computed once."""
    q, k, v, table, spans = case_inputs(case)
    return {softcap: (want(q, k, v, table, **spans, softcap=softcap), {
        window: (want(q, k, v, table, **spans, window=window, softcap=softcap),
                 run("xla", q, k, v, table, **spans, window=window, softcap=softcap))
        for window in windows}) for softcap in (0.0, 2.0)}


def check_windows(path, case: tuple, windows: tuple):
    """The C++ kernel on `path` against float64 NumPy and the XLA path for each window, with
    and without a softcap; a window shorter than the rows changes the result."""
    q, k, v, table, spans = case_inputs(case)
    exact_tol, xla_tol = tolerances(case[1])
    for softcap, (full, by_window) in window_references(case, windows).items():
        for window, (expected, xla_result) in by_window.items():
            got = run("cpu", q, k, v, table, **spans, window=window, softcap=softcap, path=path)
            np.testing.assert_allclose(got, expected, atol=exact_tol, rtol=exact_tol)
            np.testing.assert_allclose(got, xla_result, atol=xla_tol, rtol=xla_tol)
            if 0 < window < max(spans["kv_len"]):
                assert not np.allclose(got, full, atol=0.1)


@pytest.mark.parametrize("storage", [jnp.float32, jnp.uint16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", PATH_DIMS)
def test_kernel_paths_with_windows_match_numpy(attention_path, storage, head_dim, heads,
                                               kv_heads):
    """Each path on the shared cases (BS = 5: decode, chunks after a prefix, a whole row,
    spans of several tiles): windows of one key, inside a block, of a block, crossing block
    edges (7, 13), longer than a tile (17), the whole row (40) and beyond."""
    skip_unless_taken(attention_path, storage, head_dim)
    check_windows(attention_path, ("short", storage, head_dim, heads, kv_heads),
                  (1, 3, BS, 7, 13, 17, CAP, 1000))


@pytest.mark.parametrize("storage,head_dim,heads,kv_heads", [
    (jnp.float32, 64, 10, 2), (jnp.uint16, 64, 10, 2), (jnp.bfloat16, 128, 7, 1),
    (jnp.uint16, 64, 39, 3), (jnp.uint16, 256, 8, 4)])
def test_kernel_paths_on_long_rows(attention_path, storage, head_dim, heads, kv_heads):
    """Each path at block size 16 on rows of up to 128 keys: windows shorter than a block,
    of one block, one past it, of two blocks and one, of a tile's reach, longer than a row."""
    skip_unless_taken(attention_path, storage, head_dim)
    check_windows(attention_path, ("long", storage, head_dim, heads, kv_heads),
                  (1, 15, 16, 17, 33, 64, 200))


@pytest.mark.parametrize("storage,head_dim", [(jnp.float32, 64), (jnp.uint16, 64),
                                              (jnp.uint16, 128), (jnp.uint16, 256)])
@pytest.mark.parametrize("window", [1, 16, 20, 33])
def test_kernel_paths_never_read_blocks_before_the_window(attention_path, storage, head_dim,
                                                          window):
    """What a scheduler that frees blocks behind the window leaves: each row's blocks wholly
    before its first query's window start name unused blocks full of NaN, or lie outside the
    pool (-1, NB, 2^31 - 1). No path reads them: the output is bit for bit the clean one."""
    skip_unless_taken(attention_path, storage, head_dim)
    q, k, v, table, unused = long_inputs(storage, head_dim, 9, 3, seed=33)
    clean = run("cpu", q, k, v, table, **L_SPANS, window=window, softcap=2.0,
                path=attention_path)
    k2, v2 = (np.array(x, np.float32) for x in f64(k, v))
    k2[0, unused], v2[0, unused] = np.nan, np.nan
    k2, v2 = (to_storage(jnp.asarray(x), jnp.zeros((1,), storage)) for x in (k2, v2))
    freed = table.copy()
    stand_ins = [*unused, -1, L_NB, 2**31 - 1]
    count = 0
    for r, (n, kv) in enumerate(zip(L_Q_LEN, L_KV_LEN, strict=True)):
        for j in range(max(0, kv - n - window + 1) // L_BS if n else 0):
            freed[r, j] = stand_ins[count % len(stand_ins)]
            count += 1
    assert count >= 8
    got = run("cpu", q, k2, v2, freed, **L_SPANS, window=window, softcap=2.0,
              path=attention_path)
    np.testing.assert_array_equal(got, clean)


@pytest.mark.parametrize("storage,head_dim", [(jnp.float32, 64), (jnp.uint16, 64)])
def test_kernel_paths_skip_out_of_range_blocks_inside_a_tile(attention_path, storage,
                                                             head_dim):
    """test_out_of_range_table_entries_with_a_window on each path: row 4's block 3 out of
    range lies inside tiles whose later queries' windows start past it (their output is the
    clean one, bit for bit); queries whose window starts in it see nothing."""
    skip_unless_taken(attention_path, storage, head_dim)
    q, k, v = inputs(storage, seed=34, head_dim=head_dim, heads=9, kv_heads=3)
    table = shuffled_table(seed=34)
    clean = run("cpu", q, k, v, table, window=7, path=attention_path)
    bad = table.copy()
    bad[4, 3], bad[3, 0] = NB, -1
    got = run("cpu", q, k, v, bad, window=7, path=attention_path)
    exact_tol, _ = tolerances(storage)
    np.testing.assert_allclose(got, want(q, k, v, bad, window=7), atol=exact_tol,
                               rtol=exact_tol)
    tokens = {p: 1 + p - 6 for p in range(6, 35)}  # row 4: position -> token
    assert not got[[tokens[p] for p in range(21, 26)]].any()
    np.testing.assert_array_equal(got[[tokens[p] for p in range(26, 35)]],
                                  clean[[tokens[p] for p in range(26, 35)]])
    np.testing.assert_array_equal(got[74:87], clean[74:87])  # row 3


def test_kernel_paths_scan_alternating_windows(attention_path):
    """Gemma 2/3's use, fused as the step calls it: `write_and_attend` in a `lax.scan` over a
    bf16 pool's layers, windowed (5, 17) and global layers alternating (the window a scan
    input), soft-capped, against `write_and_attend_reference` layer by layer."""
    _, k, v = inputs(jnp.uint16, seed=35, layers=4, head_dim=64, heads=10, kv_heads=2)
    rng = np.random.default_rng(35)
    q = jnp.asarray(rng.normal(size=(T, 10, 64)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(4, T, 2, 2, 64)), jnp.float32)
    angles = rng.uniform(-7, 7, size=(T, 32))
    cos, sin = (jnp.asarray(f(angles), jnp.float32) for f in (np.cos, np.sin))
    spans = i32(shuffled_table(seed=35), Q_START, Q_LEN, KV_LEN)
    windows = jnp.asarray([5, 0, 17, 0], jnp.int32)

    def layers(fn):
        def body(pool, xs):
            layer, window, kv_l = xs
            out, *pool = fn(q, kv_l, cos, sin, *pool, *spans, layer, window=window)
            return tuple(pool), out

        return jax.jit(lambda k, v: jax.lax.scan(body, (k, v), (jnp.arange(4), windows, kv)))

    (k1, v1), got = layers(partial(ra.write_and_attend, softcap=2.0, path=attention_path))(k, v)
    (k2, v2), ref = layers(partial(ra.write_and_attend_reference, softcap=2.0))(k, v)
    for mine, theirs in ((k1, k2), (v1, v2)):  # one bf16 rounding of the same rotation
        np.testing.assert_allclose(*f64(mine, theirs), rtol=2**-7, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=5e-3, rtol=5e-3)


def test_default_path_is_the_last_that_takes_the_pool():
    """A bf16 pool of head dim 64, 128 or 256 runs the last built path by default
    (avx512_bf16 where this CPU has it); f32 pools and other head dims the portable one."""
    if not ra.available():
        pytest.skip("the C++ kernel cannot be built here")
    assert ra.paths()[0] == "portable"
    for dtype in (jnp.uint16, jnp.bfloat16):
        assert all(ra.path_for(dtype, d) == ra.paths()[-1] for d in (64, 128, 256))
        assert ra.path_for(dtype, 16) == ra.path_for(dtype, 192) == "portable"
    assert ra.path_for(jnp.float32, 64) == "portable"


def not_built() -> str:
    """The first kernel path this build lacks, else a name no build has."""
    return next((p for p in ra.PATHS if p not in ra.paths()), "sse4")


@pytest.mark.parametrize("storage,head_dim,path", [(jnp.float32, 64, "avx512_bf16"),
                                                   (jnp.uint16, 16, "avx2"),
                                                   (jnp.uint16, 64, None)])
def test_a_path_that_cannot_run_the_call_is_named(storage, head_dim, path):
    """A path that does not take the pool, or is not built here."""
    if not ra.available():
        pytest.skip("the C++ kernel cannot be built here")
    path = path or not_built()
    q, k, v = inputs(storage, head_dim=head_dim)
    spans = i32(shuffled_table(), Q_START, Q_LEN, KV_LEN)
    with pytest.raises(ValueError, match=f"path '{path}' cannot run"):
        ra.ragged_attention(q, k, v, *spans, window=7, path=path)
