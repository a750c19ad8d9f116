"""What the GPU kernel families share: the C++ names of their templates instantiated for
every cell of the table and every dtype, their source text, and the CuPy module each is
compiled into once per process. A family (kernels.py: the per-step cells; persistent.py:
the persistent layers) declares only its .cuh file and its two templates.

Needs no CuPy: compiling takes the `cupy` module.
"""
from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np

from ..config import CELLS

__all__ = ["SOURCE_DIR", "CELL_TYPES", "C_TYPES", "OPTIONS", "source_text", "KernelFamily"]

SOURCE_DIR = Path(__file__).parent
# Every mode of the table is instantiated: its struct in cells.cuh is named by the table.
CELL_TYPES = {mode: f"fusedrnn::{cell.cuda_cell}" for mode, cell in CELLS.items()}
C_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
OPTIONS = ("--std=c++14",)
_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"[ \t]*$', re.MULTILINE)


def source_text(name, _pasted=None):
    """SOURCE_DIR/name with each #include "file" replaced by that file's text, once (as
    #pragma once would: pasted text is one file to NVRTC): CuPy keys its disk cache on the
    text it is given, so an edit to an included file must change it."""
    pasted = set() if _pasted is None else _pasted
    pasted.add(name)

    def paste(match):
        included = match.group(1)
        return "" if included in pasted else source_text(included, pasted)
    return _LOCAL_INCLUDE.sub(paste, (SOURCE_DIR / name).read_text())


class KernelFamily:
    """The forward and backward kernel templates of one .cuh file, each instantiated as
    <cell, dtype> for every cell and dtype, all compiled into one CuPy RawModule."""

    def __init__(self, source_name, forward, backward, options=tuple):
        self.source_name = source_name
        self.templates = (forward, backward)
        self.options = options   # () -> the family's own NVRTC options, read at each build
        self._module = None
        self._lock = threading.Lock()

    def kernel_names(self, mode, dtype):
        """C++ names of (forward, backward) for one cell and dtype."""
        args = f"{CELL_TYPES[mode]}, {C_TYPES[np.dtype(dtype)]}"
        return tuple(f"fusedrnn::{template}<{args}>" for template in self.templates)

    def all_kernel_names(self):
        return [name for mode in CELL_TYPES for dtype in C_TYPES
                for name in self.kernel_names(mode, dtype)]

    def source(self):
        return source_text(self.source_name)

    def compile(self, cupy, *options):
        """A new RawModule of every instantiation, built by NVRTC (CuPy caches the binary
        on disk too, and loads it per device on first use)."""
        return cupy.RawModule(code=self.source(), options=OPTIONS + self.options() + options,
                              name_expressions=self.all_kernel_names())

    def cupy_module(self, cupy):
        """compile(cupy), once per process."""
        with self._lock:
            if self._module is None:
                self._module = self.compile(cupy)
            return self._module

    def cupy_functions(self, cupy, mode, dtype):
        """The (forward, backward) RawKernels of one cell and dtype."""
        module = self.cupy_module(cupy)
        return tuple(module.get_function(name) for name in self.kernel_names(mode, dtype))
