"""Where the connector writes a load (`kvbridge.vllm.layouts.slot_mapping`, no vLLM needed): slot = block · block_size
+ offset for the positions with a real block, nothing for those whose block is vLLM's null block (id 0), which a
sliding-window group's table holds before the window. The tables below are the shape vLLM 0.32 hands the connector:
for N tokens loaded into a window W, `SlidingWindowManager` puts (N - W + 1) // block_size null blocks first (the
first table is the one it gave for N = 320, W = 256, blocks of 32, read from a running engine)."""

from __future__ import annotations

import pytest
import torch
from kvbridge.vllm.layouts import NULL_BLOCK_ID, slot_mapping


def _skipped_blocks(n: int, window: int, block_size: int) -> int:
    """vLLM 0.32's null blocks in front of n loaded tokens (`SlidingWindowManager.get_num_skipped_tokens`)."""
    return max(0, n - window + 1) // block_size


def test_a_sliding_window_table_writes_past_its_null_blocks_only():
    table = [0, 0, 11, 10, 9, 8, 7, 6, 5, 4]  # vLLM's, for 320 tokens in a window of 256, blocks of 32
    kept, slots = slot_mapping(table, 0, 320, 32)
    assert torch.equal(kept, torch.arange(64, 320))  # the first two blocks' 64 positions are left out
    positions = torch.arange(64, 320)
    expected = torch.tensor(table)[positions // 32] * 32 + positions % 32
    assert torch.equal(slots, expected)
    assert int(slots.min()) >= 32  # nothing in block 0
    assert slots[0] == 11 * 32 and slots[-1] == 4 * 32 + 31


def test_a_full_attention_table_writes_every_position():
    table = [3, 1, 7, 2]
    kept, slots = slot_mapping(table, 0, 128, 32)
    assert torch.equal(kept, torch.arange(128))
    assert slots.tolist() == [table[p // 32] * 32 + p % 32 for p in range(128)]


def test_a_load_that_starts_inside_the_table():
    """Tokens before `start` are the engine's own (prefix cache): the slots are still the prompt positions'."""
    kept, slots = slot_mapping([0, 7, 8, 9, 2], 40, 100, 32)
    assert torch.equal(kept, torch.arange(100))
    assert slots[0] == 7 * 32 + 8 and slots[-1] == 2 * 32 + 11


def test_null_blocks_anywhere_in_the_table_are_left_out():
    kept, slots = slot_mapping([5, NULL_BLOCK_ID, 6], 0, 96, 32)
    assert kept.tolist() == list(range(32)) + list(range(64, 96))
    assert slots.tolist() == [5 * 32 + p for p in range(32)] + [6 * 32 + p for p in range(32)]
    kept, slots = slot_mapping([0, 0], 0, 64, 32)
    assert kept.numel() == 0 and slots.numel() == 0


@pytest.mark.parametrize("n, window, block_size", [(320, 256, 32), (544, 256, 32), (257, 256, 32), (288, 256, 32),
                                                   (4096, 2047, 128), (2047, 2047, 16), (100, 256, 32)])
def test_every_position_the_first_new_token_attends_to_is_written(n, window, block_size):
    """Loaded tokens 0..n-1, vLLM's table for them: the query at position n attends to n-window+1..n; every loaded
    one of those has a real block and is written, and only positions in whole blocks before the window are not."""
    skipped = _skipped_blocks(n, window, block_size)
    table = [0] * skipped + list(range(100, 100 + -(-n // block_size) - skipped))
    kept, slots = slot_mapping(table, 0, n, block_size)
    first_attended = max(0, n - window + 1)
    assert kept.tolist() == list(range(skipped * block_size, n))
    assert skipped * block_size <= first_attended
    assert int(slots.min()) >= block_size


def test_positions_past_the_table_are_refused():
    with pytest.raises(ValueError, match="do not fit a block table of 2 blocks of 32"):
        slot_mapping([1, 2], 40, 40, 32)
    with pytest.raises(ValueError, match="positions -1"):
        slot_mapping([1, 2], -1, 4, 32)


def test_slot_mapping_refuses_one_position_past_the_table():
    slot_mapping([1, 2], 0, 64, 32)  # fits exactly
    with pytest.raises(ValueError, match="do not fit"):
        slot_mapping([1, 2], 0, 65, 32)
