"""Why a long CPU training run's memory climbed until the OOM killer ended it, and the fix (loop.release_heap,
after every step): glibc moves its mmap threshold up to the largest block freed so far, after which
activations of a few MiB come from the heap, and one block still in use at its top keeps everything below
it resident until the heap is trimmed."""

import subprocess
import sys

import pytest

PROGRAM = """
import sys
import torch
from cloverlm.training.loop import release_heap, resident_gib
torch.empty(30 << 20, dtype=torch.uint8).fill_(1)  # a 30 MiB block freed at once: glibc's threshold moves up
before = resident_gib()[0]
held = [torch.ones(2 << 20, dtype=torch.uint8) for _ in range(300)]  # 600 MiB of 2 MiB activations
keep = held[-1]
del held  # every block freed but the last
if sys.argv[1] == "release":
    assert release_heap()
print(resident_gib()[0] - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_activations_stay_resident_under_glibcs_default_and_go_back_when_released():
    def retained(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True)
        return float(out.stdout.strip().splitlines()[-1])

    assert retained("glibc") > 0.4  # GiB still resident of the 0.6 freed
    assert retained("release") < 0.05
