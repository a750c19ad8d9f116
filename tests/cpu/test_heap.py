"""fusedrnn/cpu/heap.py: glibc's mmap threshold, raised once at a torch program's call."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import fusedrnn
from fusedrnn.cpu import heap

# In a fresh process (this one's threshold depends on what ran before) with glibc's
# defaults (no MALLOC_* or tunables, which fix the threshold): whether glibc maps a 24 MiB
# block on its own, before and after raise_mmap_threshold. A probe block is never freed:
# freeing a mapped one raises the threshold itself.
_PROBE = """
import ctypes, json
from fusedrnn.cpu import heap   # (first: an import that freed a mapped block would pass it)
libc = ctypes.CDLL(None)
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
def mapped():
    before = libc.mallinfo2().hblks
    assert libc.malloc(24 << 20)   # (an encoder's neighbour frees tensors this large)
    return libc.mallinfo2().hblks > before
first = mapped()
ran = heap.raise_mmap_threshold()
print(json.dumps([first, ran, mapped()]))
"""


def _glibc():
    return heap.glibc() is not None and hasattr(heap.glibc(), "mallinfo2")


@pytest.mark.skipif(not _glibc(), reason="glibc's allocator (mallinfo2, glibc >= 2.33) only")
def test_blocks_of_a_few_mib_come_from_the_heap_after_it():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    run = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         check=True, env=env)
    mapped_before, ran, mapped_after = json.loads(run.stdout.strip().splitlines()[-1])
    assert mapped_before, "a fresh process should map a 24 MiB block (glibc's default)"
    assert ran and not mapped_after


def test_a_numpy_programs_call_leaves_it():
    """Only a torch program's call raises it (what was measured; tests/torch has that)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 1, 3)).astype(np.float32)
    params = rng.standard_normal(fusedrnn.param_size(mode="lstm", input_size=3, state_size=4))
    heap.raise_mmap_threshold.cache_clear()
    fusedrnn.RNN(x, params.astype(np.float32), state_size=4, num_layers=1, mode="lstm")
    assert heap.raise_mmap_threshold.cache_info().misses == 0
