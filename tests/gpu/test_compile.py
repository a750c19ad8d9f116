"""Every GPU kernel (per-step cells and persistent) compiles for sm_90, sm_80 and sm_75: with
nvcc, and with NVRTC exactly as CuPy builds it (same source, options and name
expressions; the persistent kernels need no cooperative-groups option, only a
cooperative launch). Runs without a GPU; in CI (CI=true) a missing compiler fails the test instead of skipping it."""
import ctypes
import ctypes.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fusedrnn.gpu import build
from fusedrnn.gpu.halfgemm import NARROW_KERNELS
from fusedrnn.gpu.kernels import STEP_KERNELS
from fusedrnn.gpu.persistent import PERSISTENT_KERNELS

ARCHS = ["sm_90", "sm_80", "sm_75"]
# Tensor cores with bfloat16 (mma.sync m16n8k16 .bf16, cvt.rn.bf16.f32) from sm_80; sm_75
# (Turing) builds the same kernels with those paths trapping (tensorcore.cuh).
TENSOR_CORE_ARCHS = ["sm_90", "sm_80"]


def _persistent_builds(phase_clocks):
    """The persistent kernels' builds: the plain one for every arch; the instrumented one
    of fusedrnn/benchmark/gpu_phases.py (its clocks need no arch of their own) for the
    device it times on, Hopper."""
    return [pytest.param(arch, [], id=f"{arch}-plain") for arch in ARCHS] + [
        pytest.param("sm_90", [phase_clocks], id="sm_90-phase-clocks")]




def _missing(what):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} not found: CI must compile every GPU kernel (.ci/run installs it)")
    pytest.skip(f"{what} not found")


def _instantiations(header, names, params):
    """A .cu file instantiating every kernel in `names` explicitly; params(name, ctype)
    gives its parameter list."""
    lines = [f'#include "{header}"', "namespace fusedrnn {"]
    for name in names:
        ctype = re.search(r", (\w+)>$", name).group(1)
        lines.append(f"template __global__ void {name.replace('fusedrnn::', '')}"
                     f"({params(name, ctype)});")
    return "\n".join(lines + ["}"]) + "\n"


def _nvcc_entries(source_text, arch, tmp_path, *flags):
    """Compile with nvcc -Xptxas -v; returns (entry functions, ptxas report)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        _missing("nvcc")
    source = tmp_path / "kernels.cu"
    source.write_text(source_text)
    result = subprocess.run(
        [nvcc, "-std=c++14", f"-arch={arch}", *flags, "-cubin", "-Xptxas", "-v", "-Werror",
         "all-warnings", "-I", str(build.SOURCE_DIR), str(source),
         "-o", str(tmp_path / "kernels.cubin")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "spill" not in re.sub(r"0 bytes spill (stores|loads)", "", result.stderr)
    entries = re.findall(r"Compiling entry function '(\w+)' for '(\w+)'", result.stderr)
    assert {a for _, a in entries} == {arch}
    return entries, result.stderr


@pytest.mark.parametrize("arch", ARCHS)
def test_nvcc_compiles_every_kernel(arch, tmp_path):
    source = _instantiations(
        "cells.cuh", STEP_KERNELS.all_kernel_names(),
        lambda name, ctype: f"FUSEDRNN_{'FORWARD' if 'forward_step' in name else 'BACKWARD'}"
                            f"_PARAMS({ctype})")
    entries, _ = _nvcc_entries(source, arch, tmp_path)
    assert len(entries) == len(STEP_KERNELS.all_kernel_names()) == 16


@pytest.mark.parametrize("arch, defines", _persistent_builds("-DFUSEDRNN_PHASE_CLOCKS"))
def test_nvcc_compiles_every_persistent_kernel(arch, defines, tmp_path):
    source = _instantiations(
        "persistent.cuh", PERSISTENT_KERNELS.all_kernel_names(),
        lambda name, ctype: "unsigned long long*, FUSEDRNN_PERSISTENT_"
                            f"{'FORWARD' if 'persistent_forward' in name else 'BACKWARD'}"
                            f"_PARAMS({ctype})")
    entries, report = _nvcc_entries(source, arch, tmp_path, "-rdc=true", *defines)
    assert len(entries) == len(PERSISTENT_KERNELS.all_kernel_names()) == 16
    # __launch_bounds__(512): at most 128 registers, so a 512-thread block fits an SM.
    assert all(int(r) <= 128 for r in re.findall(r"Used (\d+) registers", report))


@pytest.mark.parametrize("arch", TENSOR_CORE_ARCHS)
def test_persistent_kernels_hold_both_tensor_core_products(arch, tmp_path):
    """Each float instantiation carries mma.sync m16n8k16 for float16 and for bfloat16
    operands (tensorcore.cuh), which ptxas builds for the arch (the tests above), and the
    staging's 16-byte forms: L2 loads of four words, and (the backward's exchange) shared
    stores of four."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        _missing("nvcc")
    names = [n for n in PERSISTENT_KERNELS.all_kernel_names() if n.endswith(", float>")]
    (tmp_path / "k.cu").write_text(_instantiations(
        "persistent.cuh", names,
        lambda name, ctype: "unsigned long long*, FUSEDRNN_PERSISTENT_"
                            f"{'FORWARD' if 'persistent_forward' in name else 'BACKWARD'}"
                            f"_PARAMS({ctype})"))
    result = subprocess.run([nvcc, "-std=c++14", f"-arch={arch}", "-ptx", "-I",
                             str(build.SOURCE_DIR), str(tmp_path / "k.cu"), "-o",
                             str(tmp_path / "k.ptx")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    ptx = (tmp_path / "k.ptx").read_text()
    bodies = re.split(r"\n\.(?:visible|weak) \.entry ", ptx)[1:]
    assert len(bodies) == len(names) == 8
    for body in bodies:
        entry = body.split("(", 1)[0]   # the mangled name
        for operands in ("f16.f16", "bf16.bf16"):
            assert f"mma.sync.aligned.m16n8k16.row.col.f32.{operands}.f32" in body
        assert "ld.global.cg.v4.u32" in body, entry
        if "persistent_backward" in entry:
            assert "st.shared.v4.b32" in body, entry


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


def _nvrtc_compiles(source, filename, names, options):
    """Build `source` with NVRTC as CuPy does (name expressions, then lowered names):
    every instantiation CuPy will ask for must exist in the binary."""
    nvrtc = _load_nvrtc()
    if nvrtc is None:
        _missing("NVRTC (libnvrtc)")
    prog = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source, filename, 0, None, None) == 0
    for name in names:
        assert nvrtc.nvrtcAddNameExpression(prog, name.encode()) == 0
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


@pytest.mark.parametrize("arch", ARCHS)
def test_nvrtc_compiles_every_kernel_as_cupy_does(arch):
    _nvrtc_compiles(STEP_KERNELS.source().encode(), b"cells.cuh",
                    STEP_KERNELS.all_kernel_names(),
                    [*(o.encode() for o in build.OPTIONS), f"--gpu-architecture={arch}".encode()])


@pytest.mark.parametrize("arch, defines", _persistent_builds(b"-DFUSEDRNN_PHASE_CLOCKS"))
def test_nvrtc_compiles_every_persistent_kernel_as_cupy_does(arch, defines):
    # Exactly the text CuPy is given; build.py's options plus CuPy's own -ftz=true.
    _nvrtc_compiles(PERSISTENT_KERNELS.source().encode(), b"persistent.cuh",
                    PERSISTENT_KERNELS.all_kernel_names(),
                    [*(o.encode() for o in build.OPTIONS), f"--gpu-architecture={arch}".encode(),
                     b"-ftz=true", *defines])


@pytest.mark.parametrize("arch", ARCHS)
def test_the_half_gemms_rounding_kernel_compiles(arch, tmp_path):
    """halfgemm.cuh's narrow_rows, both half types: with nvcc (from sm_80 it rounds with
    cvt.rn.f16.f32 / cvt.rn.bf16.f32; sm_75 builds it trapping, and the backend never asks
    for it there) and with NVRTC as CuPy builds it (halfgemm._module)."""
    names = list(NARROW_KERNELS.values())
    lines = ['#include "halfgemm.cuh"', "namespace fusedrnn {"]
    lines += [f"template __global__ void narrow_rows<{p}>(const float*, long long, long long, "
              f"long long, half_bits*);" for p in (1, 2)]
    source = "\n".join(lines + ["}"]) + "\n"
    entries, _ = _nvcc_entries(source, arch, tmp_path)
    assert len(entries) == 2
    if arch in TENSOR_CORE_ARCHS:
        (tmp_path / "h.cu").write_text(source)
        result = subprocess.run([shutil.which("nvcc"), "-std=c++14", f"-arch={arch}", "-ptx",
                                 "-I", str(build.SOURCE_DIR), str(tmp_path / "h.cu"), "-o",
                                 str(tmp_path / "h.ptx")], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        ptx = (tmp_path / "h.ptx").read_text()
        assert "cvt.rn.f16.f32" in ptx and "cvt.rn.bf16.f32" in ptx
    _nvrtc_compiles(build.source_text("halfgemm.cuh").encode(), b"halfgemm.cuh", names,
                    [*(o.encode() for o in build.OPTIONS), f"--gpu-architecture={arch}".encode(),
                     b"-ftz=true"])
