"""The ragged step's inputs, built on the host: one flat batch of tokens under a token budget.

A step is a list of *pieces*: each is one sequence's consecutive tokens at consecutive
positions — a chunk of its context (chunked prefill, any length) or its one decode token. The
pieces are laid end to end into a flat batch of T tokens (T a bucket; only the tail is padding)
and cut into M equal micro-batches for the pipeline stages (M = 1 without one). A piece that
straddles a cut is two spans, one per micro-batch: micro-batch m + 1 passes every stage after
micro-batch m, so its attention already sees the KV the first part wrote.

Row r of the step is piece r: its block-table row, and one span per micro-batch (q_start,
q_len, kv_len: the kernel's contract in `kernels/ragged_attention.py`). Rows are ordered so
that the pieces that sample a token come first (`last[:n_sample]`).

A decode piece may take its token from the previous step's sampled tokens on the device
(`Piece.feed`): that is how a step is dispatched before the host has seen the last one's
tokens (overlap, `executor.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxpipe.kernels.paged import OUT_OF_RANGE


class Piece(NamedTuple):
    """One sequence's tokens in a step."""

    tokens: list[int]  # the token ids fed in (a context chunk, or the last sampled token)
    start: int  # position of tokens[0]
    blocks: list[int]  # the sequence's KV blocks, in position order (enough for its end)
    feed: int = -1  # >= 0: the (one) token is row `feed` of the previous step's sampled
    # tokens, still on the device (an overlapped step: the host has not seen it yet)


class StepInputs(NamedTuple):
    """Device inputs of one step. T tokens in M micro-batches of Tm; R rows; MB blocks a row."""

    tokens: np.ndarray  # [M, Tm] i32
    positions: np.ndarray  # [M, Tm] i32
    rows: np.ndarray  # [M, Tm] i32: each token's row; R for padding (it writes no KV)
    table: np.ndarray  # [R, MB] i32: each row's blocks (OUT_OF_RANGE past them)
    q_start: np.ndarray  # [M, R] i32: where row r's span starts in micro-batch m
    q_len: np.ndarray  # [M, R] i32: its length (0: the row has no token in m)
    kv_len: np.ndarray  # [M, R] i32: keys the span's last token attends to (its position + 1)
    last: np.ndarray  # [R] i32: flat index (m * Tm + i) of each row's last token
    feed: np.ndarray  # [M, Tm] i32: row of the previous step's sampled tokens to take each
    # token from (-1: use `tokens`)


def build(pieces: list[Piece], num_tokens: int, microbatches: int, num_rows: int,
          max_blocks: int) -> StepInputs:
    """Lay `pieces` (rows 0..n-1, in order) into a batch of `num_tokens` tokens in
    `microbatches` micro-batches, with `num_rows` rows of `max_blocks` table entries."""
    total = sum(len(p.tokens) for p in pieces)
    if total > num_tokens or len(pieces) > num_rows or num_tokens % microbatches:
        raise ValueError(f"{len(pieces)} pieces of {total} tokens do not fit a step of "
                         f"{num_tokens} tokens, {num_rows} rows, {microbatches} micro-batches")
    tokens = np.zeros(num_tokens, np.int32)
    feed = np.full(num_tokens, -1, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    rows = np.full(num_tokens, num_rows, np.int32)
    table = np.full((num_rows, max_blocks), OUT_OF_RANGE, np.int32)
    starts = np.zeros(num_rows, np.int64)
    ends = np.zeros(num_rows, np.int64)
    first_pos = np.zeros(num_rows, np.int64)
    at = 0
    for r, piece in enumerate(pieces):
        n = len(piece.tokens)
        tokens[at:at + n] = piece.tokens
        feed[at] = piece.feed
        positions[at:at + n] = np.arange(piece.start, piece.start + n)
        rows[at:at + n] = r
        table[r, :len(piece.blocks)] = piece.blocks
        starts[r], ends[r], first_pos[r] = at, at + n, piece.start
        at += n
    tm = num_tokens // microbatches
    spans = _spans(starts, ends, first_pos, microbatches, tm)
    last = np.where(ends > starts, ends - 1, 0).astype(np.int32)
    shape = (microbatches, tm)
    return StepInputs(tokens.reshape(shape), positions.reshape(shape), rows.reshape(shape),
                      table, *spans, last, feed.reshape(shape))


def _spans(starts, ends, first_pos, microbatches: int, tm: int):
    """Each row's span within each micro-batch: (q_start, q_len, kv_len), each [M, R]."""
    lo = np.arange(microbatches)[:, None] * tm  # [M, 1]
    s = np.clip(starts[None, :], lo, lo + tm)  # [M, R]
    e = np.clip(ends[None, :], lo, lo + tm)
    q_len = e - s
    kv_len = np.where(q_len > 0, first_pos[None, :] + (e - starts[None, :]), 0)
    return ((s - lo).astype(np.int32), q_len.astype(np.int32), kv_len.astype(np.int32))

