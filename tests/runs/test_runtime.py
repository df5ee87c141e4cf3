"""The CPU runtime's allocator setting (runs/runtime.keep_freed_memory): after it, tensors freed and
allocated again come from memory the process kept, not fresh pages the kernel must fault in."""

import resource
import subprocess
import sys

CODE = """
import resource, torch
from rwkvx_cli.runs.runtime import keep_freed_memory
if {keep}:
    assert keep_freed_memory() and keep_freed_memory()  # once per process, cached
x = torch.randn(2048, 512)

def step():  # a training step's pattern: activations of a few MiB each, kept, then all freed
    ys = [x * 2 for _ in range(8)]
    del ys

for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(keep: bool) -> int:
    out = subprocess.run([sys.executable, "-c", CODE.format(keep=keep)], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def test_freed_tensors_come_back_without_page_faults():
    assert resource.getrusage  # Linux, glibc: what CI and the development machines run
    default, kept = _faults(False), _faults(True)
    assert default > 10 * 8 * 500  # glibc trims the freed heap top: each 4 MiB result faults ~1,000 pages in anew
    assert kept < 200
