"""The CPU runtime's allocator setting (runs/runtime.keep_freed_memory): after it, tensors freed and
allocated again come from memory the process kept, not fresh pages the kernel must fault in."""

import resource
import subprocess
import sys

CODE = """
import ctypes, resource, torch
from rwkvx_cli.runs.runtime import keep_freed_memory
if {keep}:
    assert keep_freed_memory() and keep_freed_memory()  # once per process, cached
else:
    # The control: glibc's documented default, blocks of 128 KiB and up mapped fresh and unmapped on
    # free, pinned. Left alone, glibc moves that threshold up by itself after the first free, and
    # whether a freed heap top is then trimmed depends on the layout: the unpinned default faults
    # 1,000 or 80,000 pages from one run to the next.
    assert ctypes.CDLL(None).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
x = torch.randn(2048, 512)

def step():  # a training step's pattern: activations of a few MiB each, kept, then all freed
    ys = [x * 2 for _ in range(8)]
    del ys

for _ in range(10):  # warm-up
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

ALLOCATIONS = 10 * 8  # 4 MiB results made in the measured steps


def _faults(keep: bool) -> int:
    out = subprocess.run([sys.executable, "-c", CODE.format(keep=keep)], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def test_freed_tensors_come_back_without_page_faults():
    assert resource.getrusage  # Linux, glibc: what CI and the development machines run
    fresh, kept = _faults(False), _faults(True)
    # Mapped fresh, every result faults its pages in: ~1,000 of 4 KiB each, at least one even where
    # transparent huge pages back it.
    assert fresh >= ALLOCATIONS
    # Kept, none does, but for one growth of the heap by one result's pages: now and then (1 run
    # in 12 after 3 warm-up steps, 1 in 20 after 10 under load) the footprint is reached one step
    # late, and never grows again; glibc's own unpinned default faults every step's 8 results in
    # 2 runs of 3.
    assert kept <= fresh // ALLOCATIONS + 100
