"""harness/loop/metrics.py: each phase's own peak memory."""

import mmap
import os

import pytest
import torch

from harness.loop.metrics import CLEAR_REFS, PhaseMemory, peak_memory_mb

CPU = torch.device("cpu")


@pytest.mark.slow  # allocates and frees hundreds of MB: make test
@pytest.mark.skipif(not os.access(CLEAR_REFS, os.W_OK), reason="the kernel's peak RSS cannot be reset here")
def test_a_phase_peak_is_its_own_not_the_process_peak_before_it():
    memory = PhaseMemory(CPU)
    memory.start("big")
    # 256 MiB mapped, touched and unmapped outside malloc (harness/run/allocator.py's setting keeps freed blocks)
    block, page = mmap.mmap(-1, 256 * 2**20), b"\1" * 2**20
    for _ in range(256):
        block.write(page)
    block.close()
    memory.start("small")
    torch.ones(2**10).sum()
    got = memory.metrics()
    assert got["peak_mem_big_mb"] - got["peak_mem_small_mb"] > 200
    assert got["peak_mem_mb"] == got["peak_mem_big_mb"] and got["peak_mem_small_mb"] <= peak_memory_mb(CPU) + 1
    assert set(memory.metrics(total=False)) == {"peak_mem_big_mb", "peak_mem_small_mb"}
