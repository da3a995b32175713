"""harness/run/allocator.py: freed memory is reused without page faults once the command line has set glibc up, the
environment switch turns it off, and release_freed_memory gives the pages back. Each case runs in a fresh process
(the settings are process-wide)."""

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                 reason="glibc's mallopt only"),
              pytest.mark.slow]  # two fresh processes importing torch, kept out of `make test-fast`

FAULTS = """
import json, resource, torch
from harness.run.allocator import keep_freed_memory, release_freed_memory
kept = keep_freed_memory()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
held = []
def touch():  # a step's worth: one block above glibc's default mmap threshold (64 MiB) and smaller ones
    before = faults()
    big, small = torch.ones(16 << 20), [torch.ones(1 << 20) for _ in range(8)]
    held.append(rss())
    del big, small
    return faults() - before
first, second, third = touch(), touch(), touch()  # the heap's layout settles within a step or two
freed = held[-1] - rss()  # what the third step's `del` gave back to the kernel
release_freed_memory()
print(json.dumps({"kept": kept, "first": first, "third": third, "freed": freed, "after_release": touch()}))
"""


def faults(env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True, check=True,
                         env={**os.environ, **env})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_memory_is_reused_and_given_back():
    pages = (64 + 32) * 2**20 // 4096  # the blocks' 4 KiB pages
    kept = faults({})
    assert kept["kept"] and kept["first"] > pages // 2
    assert kept["third"] < pages // 20  # the same pages again: no faults
    assert kept["after_release"] > pages // 2  # given back: faulted in anew


def test_the_environment_switch_keeps_glibc_defaults():
    pages = 64 * 2**20 // 4096
    default = faults({"RLVR_KEEP_FREED_MEMORY": "0"})
    assert not default["kept"] and default["third"] > pages // 2  # the 64 MiB block is mmap'd and faulted again


def test_release_gives_every_freed_block_back_at_once():
    """`RLVR_KEEP_FREED_MEMORY=release`: every block of the step, the 1 MiB ones too, is unmapped when freed, so the
    resident set drops by the whole step's 96 MiB and the next step faults every page in again. (glibc's defaults
    may or may not keep the 1 MiB blocks, by where its dynamic threshold stands: not asserted.)"""
    pages = (64 + 32) * 2**20 // 4096
    release = faults({"RLVR_KEEP_FREED_MEMORY": "release"})
    assert not release["kept"] and release["third"] > pages * 9 // 10  # every page of the step faulted again
    assert release["freed"] > 90 * 2**20  # (kept, the default, gives nothing back: the test above faults nothing)


def test_a_bad_switch_is_refused_in_one_line(monkeypatch, capsys):
    from harness.apps.cli import main

    monkeypatch.setenv("RLVR_KEEP_FREED_MEMORY", "yes")  # refused before anything is set: nothing process-wide
    assert main(["list"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == ("config error: RLVR_KEEP_FREED_MEMORY='yes': set it to 0 (glibc's defaults), "
                                         "1 (keep freed memory) or release (give it back at once), or unset it")
