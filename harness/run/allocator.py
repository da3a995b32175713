"""Keep freed CPU memory in the process, so that every training step after the first reuses the pages of the one
before instead of asking the kernel for fresh ones.

By default glibc's malloc hands blocks of 32 MiB and more (an update's logits, [rows, positions, vocab]) straight to
``mmap`` and gives freed memory at the top of its heap back to the kernel: every step then page-faults its activations,
logits and gradients in again, and each first touch of a page costs a fault and the zeroing of the page
(docs/results_benchmark.md measures what that costs a SmolLM2 update). ``keep_freed_memory`` sets ``M_MMAP_MAX = 0``
(every block from the heap) and ``M_TRIM_THRESHOLD`` to its maximum (the heap never shrinks): the process keeps its peak
memory between steps, as PyTorch's CUDA caching allocator does on a GPU. Called once by the command line (``python -m
harness ...``) before any work; glibc only (elsewhere nothing changes). ``RLVR_KEEP_FREED_MEMORY``:

- ``1`` (or unset): keep freed memory, as above (the speed default);
- ``0``: glibc's defaults. Its mmap threshold is dynamic: once a block of up to 32 MiB mmap'd is freed, blocks of
  that size come from the heap, where what is freed between live blocks stays resident, so a long run's resident
  set grows well above what its tensors hold at any moment;
- ``release``: give freed memory back at once: every block of ``RELEASE_THRESHOLD`` bytes or more is mmap'd and
  unmapped when freed (a fixed threshold, ``M_MMAP_THRESHOLD``), and the heap is trimmed above that much free at
  its top (``M_TRIM_THRESHOLD``), so the resident set follows the live tensors (the lowest peak; each step faults
  its pages in again: the slowest).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

from harness.run.errors import ConfigError

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc's mallopt parameters (malloc.h)
ENV = "RLVR_KEEP_FREED_MEMORY"
SWITCHES = ("0", "1", "release")
RELEASE_THRESHOLD = 128 * 1024  # `release`: glibc's default initial mmap threshold, kept fixed


def _glibc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def keep_freed_memory() -> bool:
    """Set glibc up as ``RLVR_KEEP_FREED_MEMORY`` says (module docstring); True when freed memory is kept."""
    switch = os.environ.get(ENV, "1")
    if switch not in SWITCHES:
        raise ConfigError(f"{ENV}={switch!r}: set it to 0 (glibc's defaults), 1 (keep freed memory) or release "
                          "(give it back at once), or unset it")
    libc = _glibc()
    if libc is None or switch == "0":
        return False
    if switch == "release":
        libc.mallopt(M_MMAP_THRESHOLD, RELEASE_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, RELEASE_THRESHOLD)
        return False
    # mallopt's value is an int; glibc reads the trim threshold as a size_t, so -1 is its largest value
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))


def release_freed_memory() -> None:
    """Give every free page of the heap back to the kernel (``malloc_trim(0)``): the next allocations fault their
    pages in again, as a fresh process's would. The bench calls it before each side it times."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
