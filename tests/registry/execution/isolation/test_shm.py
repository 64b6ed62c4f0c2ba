"""Shared memory blocks: allocation, merging when freed, the region seen by two mappings."""

from __future__ import annotations

import os
import random

import numpy as np

from plugserve.registry.execution.isolation.shm import ALIGN, Allocator, Region


def test_blocks_are_aligned_and_do_not_overlap() -> None:
    allocator = Allocator(4096)
    offsets = [allocator.alloc(n) for n in (1, 100, 64, 700)]
    assert offsets == [0, 64, 192, 256]
    assert all(o is not None and o % ALIGN == 0 for o in offsets)
    assert allocator.alloc(4096) is None  # not that much left


def test_freed_blocks_merge_back_into_one() -> None:
    allocator = Allocator(64 * 100)
    rng = random.Random(7)
    taken = [allocator.alloc(rng.randint(1, 200)) for _ in range(20)]
    assert None not in taken
    rng.shuffle(taken)
    for offset in taken:
        assert offset is not None
        allocator.free(offset)
    assert allocator.used == 0
    assert allocator.alloc(64 * 100) == 0  # the whole region again: every block merged


def test_a_block_freed_twice_or_never_taken_changes_nothing() -> None:
    allocator = Allocator(1024)
    first = allocator.alloc(64)
    assert first == 0
    allocator.free(first)
    allocator.free(first)
    allocator.free(512)
    assert allocator.alloc(1024) == 0
    assert allocator.alloc(1) is None


def test_a_region_received_as_a_descriptor_shares_its_bytes() -> None:
    ours = Region(1 << 16)
    assert ours.fd is not None
    theirs = Region(1 << 16, os.dup(ours.fd))  # as a second process maps what it was sent
    ours.close_fd()
    np.ndarray((4,), np.float32, buffer=ours.map, offset=128)[...] = [1, 2, 3, 4]
    seen = np.ndarray((4,), np.float32, buffer=theirs.map, offset=128)
    assert seen.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert theirs.fd is None
