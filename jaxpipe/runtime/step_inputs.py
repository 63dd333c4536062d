"""The ragged step's inputs, built on the host: one flat batch of tokens under a token budget,
and the stack of them a pipeline tick runs.

A step (a micro-batch, when the layout pipelines) is a list of *pieces*: each is one
sequence's consecutive tokens at consecutive positions — a chunk of its context (chunked
prefill, any length) or its one decode token. The pieces are laid end to end into a flat batch
of T tokens (T a bucket; only the tail is padding). Row r of the step is piece r: its
block-table row and its span (q_start, q_len, kv_len: the kernel's contract in
`kernels/ragged_attention.py`). Rows are ordered so that the pieces that sample a token come
first (`last[:n_sample]`).

A pipeline tick runs the micro-batches in flight, one per stage (`stack`): the same arrays with
a leading axis of one slot per stage, each micro-batch padded to the tick's token and row
buckets; a slot with no micro-batch holds an idle one, whose tokens write no KV.

A decode piece may take its token from the previous step's sampled tokens on the device
(`Piece.feed`): that is how a step is dispatched before the host has seen the last one's
tokens (overlap, `engine/executor.py`).
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
    """Device inputs of one step of T tokens and R rows of MB blocks (a tick's stack: the same
    with a leading axis of one slot per stage)."""

    tokens: np.ndarray  # [T] i32
    positions: np.ndarray  # [T] i32
    rows: np.ndarray  # [T] i32: each token's row; R for padding (it writes no KV)
    table: np.ndarray  # [R, MB] i32: each row's blocks (OUT_OF_RANGE past them)
    q_start: np.ndarray  # [R] i32: where row r's span starts
    q_len: np.ndarray  # [R] i32: its length (0: an idle row)
    kv_len: np.ndarray  # [R] i32: keys the span's last token attends to (its position + 1)
    last: np.ndarray  # [R] i32: index of each row's last token
    feed: np.ndarray  # [T] i32: row of the previous step's sampled tokens to take each token
    # from (-1: use `tokens`)

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[-1]

    @property
    def num_rows(self) -> int:
        return self.table.shape[-2]


def build(pieces: list[Piece], num_tokens: int, num_rows: int, max_blocks: int) -> StepInputs:
    """Lay `pieces` (rows 0..n-1, in order) into a batch of `num_tokens` tokens with
    `num_rows` rows of `max_blocks` table entries."""
    total = sum(len(p.tokens) for p in pieces)
    if total > num_tokens or len(pieces) > num_rows:
        raise ValueError(f"{len(pieces)} pieces of {total} tokens do not fit a step of "
                         f"{num_tokens} tokens and {num_rows} rows")
    tokens = np.zeros(num_tokens, np.int32)
    feed = np.full(num_tokens, -1, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    rows = np.full(num_tokens, num_rows, np.int32)
    table = np.full((num_rows, max_blocks), OUT_OF_RANGE, np.int32)
    q_start, q_len, kv_len = (np.zeros(num_rows, np.int32) for _ in range(3))
    at = 0
    for r, piece in enumerate(pieces):
        n = len(piece.tokens)
        tokens[at:at + n] = piece.tokens
        feed[at] = piece.feed
        positions[at:at + n] = np.arange(piece.start, piece.start + n)
        rows[at:at + n] = r
        table[r, :len(piece.blocks)] = piece.blocks
        q_start[r], q_len[r], kv_len[r] = at, n, piece.start + n
        at += n
    last = np.where(q_len > 0, q_start + q_len - 1, 0).astype(np.int32)
    return StepInputs(tokens, positions, rows, table, q_start, q_len, kv_len, last, feed)


def idle(num_tokens: int, num_rows: int, max_blocks: int) -> StepInputs:
    """A step with no token: every row idle, every token padding (it writes no KV)."""
    return build([], num_tokens, num_rows, max_blocks)


def stack(slots: list[StepInputs | None], num_tokens: int, num_rows: int) -> StepInputs:
    """One tick's inputs: the micro-batch of each slot (None: an idle one), each padded to
    `num_tokens` tokens and `num_rows` rows, stacked along a leading slot axis."""
    max_blocks = next(s.table.shape[1] for s in slots if s is not None)
    padded = [pad(s, num_tokens, num_rows) if s is not None
              else idle(num_tokens, num_rows, max_blocks) for s in slots]
    return StepInputs(*(np.stack(parts) for parts in zip(*padded, strict=True)))


def pad(inputs: StepInputs, num_tokens: int, num_rows: int) -> StepInputs:
    """`inputs` with more padding tokens and idle rows (padding tokens point at the new R)."""
    t, r = inputs.num_tokens, inputs.num_rows
    if (t, r) == (num_tokens, num_rows):
        return inputs
    if t > num_tokens or r > num_rows:
        raise ValueError(f"a step of {t} tokens and {r} rows does not fit {num_tokens} tokens "
                         f"and {num_rows} rows")
    rows = np.where(inputs.rows >= r, num_rows, inputs.rows)
    more_t, more_r = (0, num_tokens - t), (0, num_rows - r)
    return StepInputs(
        np.pad(inputs.tokens, more_t), np.pad(inputs.positions, more_t),
        np.pad(rows, more_t, constant_values=num_rows),
        np.pad(inputs.table, (more_r, (0, 0)), constant_values=OUT_OF_RANGE),
        np.pad(inputs.q_start, more_r), np.pad(inputs.q_len, more_r),
        np.pad(inputs.kv_len, more_r), np.pad(inputs.last, more_r),
        np.pad(inputs.feed, more_t, constant_values=-1))
