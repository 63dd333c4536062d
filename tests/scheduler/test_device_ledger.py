"""The device store's ledger on its own: slots lowest first and never two alike, blocks given
out only here (positionally, FREED before a window), given back when the window moves past
them or the sequence leaves, and the sizes the policies reserve with (growth, peak, need,
resume)."""

from __future__ import annotations

import pytest

from jaxpipe.scheduler import SeqInfo
from jaxpipe.scheduler.blocks import Blocks
from jaxpipe.scheduler.device_ledger import DeviceLedger
from jaxpipe.scheduler.prefix_cache import FREED, BlockPool

UNIT = 4


def ledger(blocks: int = 8, slots: int = 3, window: int = 0) -> DeviceLedger:
    return DeviceLedger(blocks * UNIT, slots, Blocks(UNIT, window), BlockPool(blocks, UNIT))


def at(computed: int, prompt: int = 40) -> SeqInfo:
    """A sequence whose first `computed` positions have KV (past its prompt: decoding)."""
    seq = SeqInfo("s", prompt, 40)
    seq.computed, seq.generated = computed, max(computed - prompt + 1, 0)
    return seq


def test_slots_go_lowest_first_and_come_back():
    kv = ledger(slots=2)
    a, b, c = SeqInfo("a", 1, 1), SeqInfo("b", 1, 1), SeqInfo("c", 1, 1)
    kv.enter(a)
    kv.enter(b)
    assert (a.slot, b.slot, kv.free_slots) == (0, 1, 0)
    with pytest.raises(RuntimeError, match="no free slot for 'c', all 2 are held"):
        kv.enter(c)
    kv.leave(a)
    kv.enter(c)
    assert (a.slot, c.slot) == (None, 0)


def test_blocks_are_given_in_position_order_and_charged_once():
    kv = ledger()
    seq = SeqInfo("a", 9, 4)
    kv.enter(seq)
    assert kv.new_blocks(seq, 9) == 3
    kv.extend(seq, 9)
    assert len(seq.blocks) == 3 == len(set(seq.blocks)) and kv.used == 12 == kv.held(seq)
    kv.extend(seq, 9)  # nothing more for positions it has blocks for
    assert kv.used == 12 and kv.free == 20 and kv.peak_blocks == 3
    with pytest.raises(RuntimeError, match="'a' needs 6 more blocks of 4 tokens, 5 of 8"):
        kv.extend(seq, 9 + 6 * UNIT)
    kv.leave(seq)
    assert (seq.blocks, kv.used, kv.free) == ([], 0, 32)
    kv.reset_peak()
    assert kv.peak_blocks == 0


def test_a_window_gives_back_what_it_moved_past():
    """Window 6, blocks of 4: the next query at 13 reads from 8 (block 2), so blocks 0-1 go
    back (FREED in place); a sequence swapped back in at 13 takes only blocks 2-3."""
    kv = ledger(window=6)
    seq = at(13)
    kv.enter(seq)
    kv.extend(seq, 13)
    kept = seq.blocks[2:]
    kv.slide(seq)
    assert seq.blocks == [FREED, FREED, *kept] and seq.behind == 2 and kv.used == 8
    kv.slide(seq)  # nothing more to give back
    assert kv.pool.num_free == 6
    back = at(13)
    assert kv.resume(back) == 2 * UNIT  # blocks 2 and 3 (position 13: its next token)
    kv.enter(back)
    kv.extend(back, 13)
    assert back.blocks[:2] == [FREED, FREED] and back.behind == 2 and kv.held(back) == 8
    kv.leave(back)
    assert back.behind == 0 and kv.used == 8


def test_growth_peak_need_and_resume():
    """Blocks of 4, window 6: a decode reads 6 positions (at most 3 blocks); a 20-token
    prompt in chunks of 8 takes 2 blocks for its first chunk, 13 positions for each later
    one (at most 4 blocks), in one chunk its 5; never more than the whole length."""
    kv = ledger(blocks=16, window=6)
    assert kv.growth(at(8)) == UNIT and kv.growth(at(9)) == 0
    prompt = SeqInfo("p", 20, 10)
    assert kv.peak(prompt, 31, chunk=8) == 4 * UNIT
    assert kv.peak(prompt, 31, chunk=32) == 5 * UNIT  # one chunk of 20: its 5 blocks
    assert kv.peak(SeqInfo("q", 3, 1), 4, chunk=8) == UNIT  # the whole length
    assert kv.peak(at(40), 60) == 3 * UNIT
    assert kv.need(at(40), 60) == 3 * UNIT  # it holds nothing yet
    plain = ledger(blocks=16)
    assert plain.peak(prompt, 31, chunk=8) == 8 * UNIT and plain.resume(at(13)) == 4 * UNIT


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="device_kv_tokens >= 1.*max_device_seqs >= 1"):
        DeviceLedger(16, 0, Blocks(UNIT), BlockPool(4, UNIT))
