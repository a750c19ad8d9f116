"""fusedrnn.config.CELLS is the one table a mode is defined by (issue 22).

Every mode of the table is known to each place that must know it (the CPU units, the
CUDA source, the test reference, torch.nn and the drop-in modules, the layout), and no
other file dispatches on a mode's name: adding a mode touches config.py, cpu/units.py,
gpu/cells.cuh and tests/reference.py only (docs/internals.md#adding-a-cell).
"""
import re
from pathlib import Path

import pytest

import fusedrnn
from fusedrnn.cpu import units
from fusedrnn.gpu import build, kernels, persistent

from conftest import CELLS, MODES
from reference import GATES, param_count

ROOT = Path(__file__).resolve().parents[1]
CUDA_SOURCE = kernels.STEP_KERNELS.source()


def test_modes_are_the_tables():
    assert fusedrnn.MODES == MODES == tuple(CELLS)


@pytest.mark.parametrize("mode", MODES)
def test_cpu_units_know_the_mode(mode):
    assert mode in units.FORWARD_UNITS and mode in units.BACKWARD_UNITS
    # The kernels dispatch on this index with an if-chain in units.py, in table order.
    assert units.MODE_INDEX[mode] == list(CELLS).index(mode)


@pytest.mark.parametrize("mode", MODES)
def test_cuda_source_declares_the_cell(mode):
    name = CELLS[mode].cuda_cell
    # `struct Name {` or `typedef ... Name;` in namespace fusedrnn
    assert re.search(rf"\bstruct {name}\b|\btypedef [^;]*\b{name};", CUDA_SOURCE), name
    qualified = f"fusedrnn::{name}"
    assert build.CELL_TYPES[mode] == qualified
    for family in (kernels.STEP_KERNELS, persistent.PERSISTENT_KERNELS):
        names = family.all_kernel_names()
        assert sum(qualified + "," in n for n in names) == 2 * len(build.C_TYPES)


@pytest.mark.parametrize("mode", MODES)
def test_reference_defines_the_mode(mode):
    assert GATES[mode] == CELLS[mode].gates
    assert param_count(mode, 3, 4, 2, 2) == fusedrnn.param_size(
        mode=mode, input_size=3, state_size=4, num_layers=2, bidirectional=True)


@pytest.mark.parametrize("mode", MODES)
def test_torch_classes_match_the_table(mode):
    torch = pytest.importorskip("torch")
    import fusedrnn.torch as ft
    cell, I, H = CELLS[mode], 3, 5
    theirs = getattr(torch.nn, cell.torch_class)(I, H, num_layers=2, **cell.torch_kwargs)
    assert theirs.weight_ih_l0.shape == (cell.gates * H, I)
    assert theirs.weight_hh_l0.shape == (cell.gates * H, H)
    layout = fusedrnn.param_layout(mode=mode, input_size=I, state_size=H, num_layers=2)
    assert layout.size == sum(p.numel() for p in theirs.parameters())
    ours = getattr(ft, cell.torch_class)(I, H, num_layers=2, **cell.torch_kwargs)
    assert ours.mode == mode and ours.weight.numel() == layout.size
    outputs = ours(torch.randn(4, 2, I))[1]
    assert isinstance(outputs, tuple) == cell.has_cell_state  # (h, c) only with a cell state


def test_feature_flags_are_what_validation_enforces():
    for mode, cell in CELLS.items():
        kw = dict(mode=mode, input_size=3, state_size=4)
        if cell.projection:
            assert fusedrnn.param_layout(**kw, projection_size=2).config.projection_size == 2
        else:
            with pytest.raises(ValueError, match="projection_size"):
                fusedrnn.param_layout(**kw, projection_size=2)


# ---- no per-mode dispatch outside the table's four files ----

# Files that may name modes: the table, the two unit maths, the independent reference,
# and this test. Other files name a mode only as data (a case, a parametrize list).
ALLOWED = {"fusedrnn/config.py", "fusedrnn/cpu/units.py", "tests/reference.py",
           "tests/test_cell_table.py"}
_MODE_NAMES = "|".join(re.escape(m) for m in MODES)
FORBIDDEN = {
    # mode == "lstm", cfg.mode != "lstm", kwargs["mode"] == "lstm"
    "a mode compared with a name": re.compile(r"""mode\W{0,3}\s*[!=]=\s*["']"""),
    "a mode tested against names": re.compile(r"""(?<!for )\b\w*mode\W{0,3} (?:not )?in \(["']"""),
    "a torch name cut from a mode": re.compile(r"mode\[\d*:|mode\.split\(|mode\.upper\("),
    "a per-mode dict literal": re.compile(rf"""\{{\s*["'](?:{_MODE_NAMES})["']\s*:"""),
    "a torch class chosen by mode": re.compile(r"\.get\(\w*mode\b[^)]*torch\.nn"),
}


def _sources():
    for top in ("fusedrnn", "tests", "examples"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in ALLOWED:
                yield rel, path.read_text()


@pytest.mark.parametrize("line", [
    'if mode == "lstm":',
    '    cy = result[2] if kwargs["mode"] == "lstm" else None',
    'if cfg.mode != "lstm":',
    'extra = {} if mode in ("lstm", "gru") else {"nonlinearity": mode[4:]}',
    'return nn.RNN(*args, nonlinearity=mode.split("_")[1], **kwargs)',
    'cls = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}.get(mode, torch.nn.RNN)',
    'gates = {"lstm": 4, "gru": 3}[mode]',
])
def test_the_scan_catches_dispatch(line):
    assert any(p.search(line) for p in FORBIDDEN.values()), line


@pytest.mark.parametrize("line", [
    'for mode in ("gru", "lstm")]',
    'if mode == 0:',
    'case, kw, _ = make_case("lstm", L=2)',
    'cell = CELLS[mode]',
])
def test_the_scan_passes_data(line):
    assert not any(p.search(line) for p in FORBIDDEN.values()), line


def test_no_per_mode_dispatch_outside_the_table():
    found = [f"{rel}:{n}: {what}: {line.strip()}"
             for rel, text in _sources()
             for n, line in enumerate(text.splitlines(), 1)
             for what, pattern in FORBIDDEN.items() if pattern.search(line)]
    assert not found, "read CELLS[mode] instead:\n" + "\n".join(found)


def test_kernel_sources_name_no_cell_outside_the_table():
    # build.py derives the instantiations kernels.py / persistent.py declare, the host
    # harness gets them with -D from host_backend.py: none of them spells a cell struct.
    for rel in ("fusedrnn/gpu/build.py", "fusedrnn/gpu/kernels.py", "fusedrnn/gpu/persistent.py",
                "tests/gpu/host_harness.cpp", "tests/gpu/host_backend.py"):
        text = (ROOT / rel).read_text()
        named = [c.cuda_cell for c in CELLS.values() if re.search(rf"\b{c.cuda_cell}\b", text)]
        assert not named, (rel, named)
