"""Every GPU kernel (per-step cells and persistent) compiles for sm_90 and sm_80: with
nvcc, and with NVRTC exactly as CuPy builds it (same source, options and name
expressions; the persistent kernels with CuPy's cooperative-groups option). Runs without a GPU; in CI
(CI=true) a missing compiler fails the test instead of skipping it."""
import ctypes
import ctypes.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fusedrnn.gpu import kernels, persistent

ARCHS = ["sm_90", "sm_80"]


def _missing(what):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} not found: CI must compile every GPU kernel (.ci/run installs it)")
    pytest.skip(f"{what} not found")


def _explicit_instantiations():
    lines = ['#include "cells.cuh"', "namespace fusedrnn {"]
    for name in kernels.all_kernel_names():
        kind = "FORWARD" if "forward_step" in name else "BACKWARD"
        ctype = re.search(r", (\w+)>$", name).group(1)
        lines.append(f"template __global__ void {name.replace('fusedrnn::', '')}"
                     f"(FUSEDRNN_{kind}_PARAMS({ctype}));")
    return "\n".join(lines + ["}"]) + "\n"


@pytest.mark.parametrize("arch", ARCHS)
def test_nvcc_compiles_every_kernel(arch, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        _missing("nvcc")
    source = tmp_path / "all_kernels.cu"
    source.write_text(_explicit_instantiations())
    result = subprocess.run(
        [nvcc, "-std=c++14", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-Werror",
         "all-warnings", "-I", str(kernels.SOURCE_PATH.parent), str(source),
         "-o", str(tmp_path / "all.cubin")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    entries = re.findall(r"Compiling entry function '(\w+)' for '(\w+)'", result.stderr)
    assert len(entries) == len(kernels.all_kernel_names()) == 16
    assert {a for _, a in entries} == {arch}
    assert "spill" not in re.sub(r"0 bytes spill (stores|loads)", "", result.stderr)


def _load_nvrtc():
    candidates = []
    try:
        import nvidia.cuda_nvrtc as pkg  # the nvidia-cuda-nvrtc-cu12 wheel
        candidates += sorted(Path(list(pkg.__path__)[0], "lib").glob("libnvrtc.so*"))
    except ImportError:
        pass
    found = ctypes.util.find_library("nvrtc")
    candidates += [found] if found else []
    for path in candidates:
        try:
            return ctypes.CDLL(str(path))
        except OSError:
            continue
    return None


@pytest.mark.parametrize("arch", ARCHS)
def test_nvrtc_compiles_every_kernel_as_cupy_does(arch):
    nvrtc = _load_nvrtc()
    if nvrtc is None:
        _missing("NVRTC (libnvrtc)")
    prog = ctypes.c_void_p()
    src = kernels.SOURCE_PATH.read_bytes()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, b"cells.cuh", 0, None, None) == 0
    names = kernels.all_kernel_names()
    for name in names:
        assert nvrtc.nvrtcAddNameExpression(prog, name.encode()) == 0
    options = [b"--std=c++14", f"--gpu-architecture={arch}".encode()]
    status = nvrtc.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * 2)(*options))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert status == 0, log.value.decode()
    for name in names:  # every instantiation CuPy will ask for exists in the binary
        lowered = ctypes.c_char_p()
        assert nvrtc.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(lowered)) == 0
        assert lowered.value.startswith(b"_ZN8fusedrnn")
    assert nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)) == 0 and size.value > 0
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


def _persistent_instantiations():
    lines = ['#include "persistent.cuh"', "namespace fusedrnn {"]
    for name in persistent.all_kernel_names():
        kind = "FORWARD" if "persistent_forward" in name else "BACKWARD"
        ctype = re.search(r", (\w+)>$", name).group(1)
        lines.append(f"template __global__ void {name.replace('fusedrnn::', '')}"
                     f"(unsigned long long*, FUSEDRNN_PERSISTENT_{kind}_PARAMS({ctype}));")
    return "\n".join(lines + ["}"]) + "\n"


@pytest.mark.parametrize("arch", ARCHS)
def test_nvcc_compiles_every_persistent_kernel(arch, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        _missing("nvcc")
    source = tmp_path / "persistent.cu"
    source.write_text(_persistent_instantiations())
    result = subprocess.run(
        [nvcc, "-std=c++14", f"-arch={arch}", "-rdc=true", "-cubin", "-Xptxas", "-v",
         "-Werror", "all-warnings", "-I", str(persistent.SOURCE_PATH.parent), str(source),
         "-o", str(tmp_path / "persistent.cubin")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    entries = re.findall(r"Compiling entry function '(\w+)' for '(\w+)'", result.stderr)
    assert len(entries) == len(persistent.all_kernel_names()) == 16
    assert "spill" not in re.sub(r"0 bytes spill (stores|loads)", "", result.stderr)
    # __launch_bounds__(512): at most 128 registers, so a 512-thread block fits an SM.
    assert all(int(r) <= 128 for r in re.findall(r"Used (\d+) registers", result.stderr))


@pytest.mark.parametrize("arch", ARCHS)
def test_nvrtc_compiles_every_persistent_kernel_as_cupy_does(arch):
    nvrtc = _load_nvrtc()
    if nvrtc is None:
        _missing("NVRTC (libnvrtc)")
    prog = ctypes.c_void_p()
    src = persistent.source().encode()   # exactly the text CuPy is given
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, b"persistent.cuh", 0, None,
                                    None) == 0
    names = persistent.all_kernel_names()
    for name in names:
        assert nvrtc.nvrtcAddNameExpression(prog, name.encode()) == 0
    # persistent.py's options, plus the one CuPy adds to every build.
    options = [b"--std=c++14", f"--gpu-architecture={arch}".encode(), b"-ftz=true"]
    status = nvrtc.nvrtcCompileProgram(prog, len(options),
                                       (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert status == 0, log.value.decode()
    for name in names:
        lowered = ctypes.c_char_p()
        assert nvrtc.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(lowered)) == 0
        assert lowered.value.startswith(b"_ZN8fusedrnn")
    assert nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)) == 0 and size.value > 0
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
