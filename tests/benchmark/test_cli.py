"""The benchmark CLI in a small real run over every kind of group (grid cells, a train step,
per-case rows, first use): the tables' structure and every number in them and in the
JSON finite and positive, the plots written. No timing is asserted. Then the report's
arithmetic and the case definitions, without running anything."""
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fusedrnn.benchmark import cases as case_lib
from fusedrnn.benchmark import report
from fusedrnn.benchmark.cases import Case
from fusedrnn.benchmark.peers import OP_PEERS

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")
GROUPS = "grid,train-step,design-doc,seq2seq,cold"
# Two grid cells of each mode and kind, the tagger, two design-doc rows, the decoder step.
FILTER = r"^\w+ T=20 N=1 I=64 |tagger|first use|^lstm T=1 N=64|^gru T=50 N=20 I=256 H=256 (L=2 bi )?infer"


def _selected():
    return [c for c in case_lib.cases(GROUPS.split(","), quick=True) if re.search(FILTER, c.name)]


# The tests that read quick_run share one worker (.ci/run's --dist loadgroup), so its
# module-scoped run happens once, not once per worker.
QUICK_RUN = pytest.mark.xdist_group("bench-quick-run")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    done = subprocess.run(
        [sys.executable, "-m", "fusedrnn", "bench", "--quick", "--repeats", "2", "--block-ms",
         "5", "--cases", GROUPS, "--filter", FILTER, "--json", str(out / "r.json"),
         "--plot", str(out / "b.png"), "--heatmap", str(out / "g.png")],
        capture_output=True, text=True, cwd=out, env=ENV, timeout=900)
    assert done.returncode == 0, done.stderr
    return done.stdout, json.loads((out / "r.json").read_text()), out


def _rows(stdout, title):
    section = stdout.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows]


def _numbers(cells):
    return [float(x) for cell in cells if cell != "n/a" for x in NUMBER.findall(cell)]


def test_selection_covers_every_group():
    assert {c.group for c in _selected()} == set(GROUPS.split(","))
    assert {(c.mode, c.train) for c in _selected() if c.group == "grid"} == {
        (m, t) for m in case_lib.CELLS for t in (False, True)}


@QUICK_RUN
def test_header_names_the_machine_and_its_ceilings(quick_run):
    stdout, doc, _ = quick_run
    assert re.search(r"on .*family \d+ model \d+, LLVM \w+", stdout)
    assert "loop timing" in stdout and "each peer in its own process" in stdout
    # float32 alone: no selected case reports another dtype's share (bfloat16's torch.mm is
    # slow on a CPU without AVX512-BF16)
    assert set(doc["ceilings"]) == {"float32"}
    assert "GEMM ceiling bfloat16" not in stdout and "GEMM ceiling float64" not in stdout
    line = re.search(r"GEMM ceiling float32 \(same run\): (\d+) GFLOP/s \((\S+);", stdout)
    assert line and float(line.group(1)) > 0
    assert doc["ceilings"]["float32"]["best"] == max(
        v for k, v in doc["ceilings"]["float32"].items()
        if k not in ("best", "by", "unavailable"))
    assert doc["ceilings"]["float32"]["by"] in doc["ceilings"]["float32"]
    assert "oneDNN" in doc["ceilings"]["float32"]  # torch is installed with the test extra


@QUICK_RUN
def test_grid_headline_and_cells(quick_run):
    stdout, _, _ = quick_run
    head = _rows(stdout, "Grid: fusedrnn vs torch.nn")
    assert head[0][:4] == ["mode", "kind", "cells", "geomean x torch"]
    body = head[1:]
    assert [(r[0], r[1]) for r in body[:-1]] == [
        (m, k) for m in case_lib.CELLS for k in ("infer", "train")]
    assert body[-1][:3] == ["all", "both", str(len(body[:-1]))]
    for row in body:
        assert all(math.isfinite(x) and x >= 0 for x in _numbers(row[2:])), row
    cells = _rows(stdout, "Grid, every cell")
    assert cells[0] == ["kind", "mode", "T", "N", "H=64"] and len(cells) == 1 + 8


@QUICK_RUN
def test_train_step_and_cases_tables(quick_run):
    stdout, _, _ = quick_run
    steps = _rows(stdout, "Training steps")
    assert len(steps) == 2 and steps[1][0].startswith("tagger: lstm")
    assert all(math.isfinite(x) and x > 0 for x in _numbers(steps[1][1:])), steps[1]
    table = _rows(stdout, "Cases")
    header, body = table[0], table[1:]
    assert header[:6] == ["case", "unit", "fusedrnn", "torch", "naive", "naive-hoisted"]
    assert header[-4:] == ["GFLOP/s", "% of ceiling", "torch GFLOP/s", "torch %"]
    expected = [c for c in _selected() if c.group in ("design-doc", "seq2seq")]
    assert [r[0] for r in body] == [c.name for c in expected]
    for row, case in zip(body, expected):
        assert all(math.isfinite(x) and x > 0 for x in _numbers(row[2:])), row
        # only the naive loops lack figures: no backward, one layer
        assert ("n/a" in row) == (case.train or case.L > 1)
    first_use = _rows(stdout, "First use")
    assert [r[1] for r in first_use[1:]] == ["fusedrnn", "torch"]


@QUICK_RUN
def test_json_and_plots(quick_run):
    _, doc, out = quick_run
    assert doc["grid_axes"] == {k: list(v) for k, v in zip("TNH", case_lib.GRID_QUICK)}
    assert [c["name"] for c in doc["cases"]] == [c.name for c in _selected()]
    for case in doc["cases"]:
        assert "fusedrnn" in case["seconds"]
        for stats in case["seconds"].values():
            values = [stats["median"], stats["min"], stats["max"]]
            assert all(math.isfinite(v) and v > 0 for v in values)
            assert stats["min"] <= stats["median"] <= stats["max"]
        if case["group"] == "train-step":
            assert {"fusedrnn neighbour", "torch neighbour"} <= set(case["seconds"])
        elif case["group"] != "cold":  # op calls: GFLOP/s and share of the ceiling per peer
            ceiling = doc["ceilings"][case["dtype"] or "float32"]["best"]
            for peer, stats in case["seconds"].items():
                gflops = case["flops"] / stats["median"] / 1e9
                assert case["gflops"][peer] == pytest.approx(gflops)
                assert case["percent_of_ceiling"][peer] == pytest.approx(100 * gflops / ceiling)
    assert (out / "g.png").stat().st_size > 10_000  # the heat map
    assert not (out / "b.png").exists()  # no batch group, no batch plot


def test_unknown_group_is_refused():
    done = subprocess.run([sys.executable, "-m", "fusedrnn", "bench", "--cases", "nope"],
                          capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert done.returncode == 2 and "unknown case groups" in done.stderr


def test_bfloat16_grid_cells_against_torch_bfloat16(tmp_path):
    """--dtype bfloat16 (CPU): fusedrnn on ml_dtypes arrays against torch.nn in
    torch.bfloat16, every figure finite and positive, the share of bfloat16's ceiling;
    the naive loops have none."""
    pytest.importorskip("ml_dtypes")
    done = subprocess.run(
        [sys.executable, "-m", "fusedrnn", "bench", "--quick", "--dtype", "bfloat16",
         "--repeats", "1", "--block-ms", "5", "--cases", "grid,seq2seq", "--filter",
         r"^lstm T=20 N=1 I=64 |^lstm T=1 N=1 I=8 H=8 infer", "--peers",
         "fusedrnn,torch,naive", "--json", str(tmp_path / "r.json"), "--heatmap",
         str(tmp_path / "g.png")], capture_output=True, text=True, cwd=tmp_path, env=ENV,
        timeout=600)
    assert done.returncode == 0, done.stderr
    assert "; bfloat16;" in done.stdout
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["dtype"] == "bfloat16" and len(doc["cases"]) == 3
    for case in doc["cases"]:
        assert set(case["seconds"]) == {"fusedrnn", "torch"}, case["name"]   # no naive
        ceiling = doc["ceilings"]["bfloat16"]["best"]
        for peer, stats in case["seconds"].items():
            assert math.isfinite(stats["median"]) and stats["median"] > 0
            gflops = case["flops"] / stats["median"] / 1e9
            assert case["percent_of_ceiling"][peer] == pytest.approx(100 * gflops / ceiling)
    head = _rows(done.stdout, "Grid: fusedrnn vs torch.nn")
    assert [(r[0], r[1], r[2]) for r in head[1:]] == [
        ("lstm", "infer", "1"), ("lstm", "train", "1"), ("all", "both", "2")]


@pytest.mark.parametrize("args", [["--cases", "train-step"], ["--cases", "grid,cold"],
                                  ["--device", "gpu", "--cases", "grid"]])
def test_bfloat16_refuses_what_it_would_mislabel(args):
    """The train steps' models and first use's scripts are float32, and the GPU's arrays
    are CuPy's (no bfloat16): refused, not run in another dtype under bfloat16's name."""
    done = subprocess.run([sys.executable, "-m", "fusedrnn", "bench", "--dtype", "bfloat16",
                           *args], capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert done.returncode == 2 and "--dtype bfloat16 runs on the CPU" in done.stderr


def _times(torch_s, fused_s=1.0):
    return {"fusedrnn": {"median": fused_s}, "torch": {"median": torch_s}}


def test_grid_headline_arithmetic():
    results = [(Case("grid", "gru", 20, n, 64, 64), _times(r))
               for n, r in ((1, 0.5), (8, 2.0), (32, 4.0))]
    lines = report.grid_headline(results).splitlines()
    gru = [c.strip() for c in lines[2].strip("|").split("|")]
    # geomean(0.5, 2, 4) = 4 ** (1/3); worst 0.5 at N=1; one cell below 0.8x
    assert gru == ["gru", "infer", "3", f"{4 ** (1 / 3):.2f}", "0.50 (T=20 N=1 H=64)", "4.00",
                   "1"]
    assert lines[-1].startswith("| all | both | 3 |")


def test_float32_on_cuda_is_against_strict_cudnn_with_the_default_beside():
    """Where the strict peer ran (cuDNN with TF32 off), a case's ratio is against it and
    torch's default is the second ratio; elsewhere the ratio is torch's and none beside."""
    def times(strict, default):
        return {"fusedrnn": {"median": 1.0}, "torch-strict": {"median": strict},
                "torch": {"median": default}}
    results = [(Case("grid", "lstm", 300, n, 800, 800, train=True), times(s, d))
               for n, s, d in ((20, 2.0, 1.0), (128, 0.5, 0.25))]
    assert report.ratio(results[0][1]) == 2.0 and report.default_ratio(results[0][1]) == 1.0
    assert report.anchor(results[0][1]) == "torch-strict"
    lines = report.grid_headline(results).splitlines()
    assert lines[0].endswith("| geomean x torch default | worst x default |")
    lstm = [c.strip() for c in lines[2].strip("|").split("|")]
    assert lstm[3:5] == ["1.00", "0.50 (T=300 N=128 H=800)"]   # geomean(2, 0.5); worst
    assert lstm[-2:] == [f"{(1.0 * 0.25) ** 0.5:.2f}", "0.25"]
    cpu = _times(3.0)
    assert report.ratio(cpu) == 3.0 and report.default_ratio(cpu) is None
    assert "default" not in report.grid_headline(
        [(Case("grid", "gru", 20, 1, 64, 64), cpu)]).splitlines()[0]


def test_strict_peer_runs_where_the_flag_changes_the_math():
    from fusedrnn.benchmark import peers
    assert peers.strict_differs("cuda", "float32")
    assert not peers.strict_differs("cpu", "float32")
    assert not peers.strict_differs("cuda", "float64")
    assert not peers.strict_differs("cuda", "float16")
    import numpy as np
    case = Case("grid", "gru", 2, 1, 4, 4)
    assert peers.make("torch-strict", case, np, "float32", "cpu") is None
    assert "torch-strict" in case_lib.peers_of(case)


@pytest.mark.alone   # (another test worker's load would be a neighbour too)
def test_a_peers_figure_does_not_depend_on_which_peers_ran(tmp_path):
    """fusedrnn's decoder step alone and beside every other peer (whose BLAS and OpenMP
    threads spin after their turns): the two runs' blocks overlap. Before turns waited
    for the others to idle, beside them it took 2.6x as long (1385 against 3597 us)."""
    spans = {}
    for peers in ("fusedrnn", ",".join(p for p in OP_PEERS if p != "torch-strict")):
        path = tmp_path / f"{len(peers)}.json"
        done = subprocess.run(
            [sys.executable, "-m", "fusedrnn", "bench", "--cases", "seq2seq", "--filter",
             "^gru T=1 N=64 ", "--repeats", "5", "--peers", peers, "--json", str(path)],
            capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=600)
        assert done.returncode == 0, done.stderr
        (case,) = json.loads(path.read_text())["cases"]
        stats = case["seconds"]["fusedrnn"]
        spans[peers] = (stats["min"], stats["max"])
    (lo_a, hi_a), (lo_b, hi_b) = spans.values()
    slack = 0.1 * min(lo_a, lo_b)   # two separate runs, each with its own drift
    assert lo_a - slack <= hi_b and lo_b - slack <= hi_a, spans


def test_a_turn_waits_for_the_other_workers_to_idle():
    """runner.wait_quiet returns once a spinning process stops, not before, and at once
    for an idle one."""
    from fusedrnn.benchmark import runner
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 0.6\n"
                             "while time.time() < end: pass\ntime.sleep(30)"])
    try:
        time.sleep(0.2)   # the interpreter is up and spinning
        assert runner.cpu_ns(busy.pid) > 0
        waited = runner.wait_quiet([busy.pid])
        assert 0.1 < waited < runner.QUIET_TIMEOUT_S
        assert runner.wait_quiet([busy.pid]) < 0.1   # asleep now
    finally:
        busy.kill()
        busy.wait()


def test_cpu_grid_is_a_subset_of_the_full_grid():
    for axis, full, cpu in zip("TNH", case_lib.GRID_FULL, case_lib.GRID_CPU):
        assert set(cpu) <= set(full), axis
    assert set(case_lib.GRID_FULL[1]) < set(case_lib.GRID_GPU[1])  # N=1024 on the GPU
    assert 2048 in case_lib.GRID_GPU[2]
    grid = case_lib.cases(["grid"], device="cpu")
    assert len(grid) == 4 * 2 * math.prod(len(a) for a in case_lib.GRID_CPU)
    assert len(case_lib.cases(["grid"], device="gpu")) == 4 * 2 * math.prod(
        len(a) for a in case_lib.GRID_GPU)


def test_side_by_side_helpers():
    """benchmark.processes: the blocks count their calls and a device's synchronize closes
    each block."""
    from fusedrnn.benchmark.processes import seconds_per_call
    calls = []
    assert seconds_per_call(lambda: calls.append(1), warmup=2, blocks=3, per_block=4) >= 0
    assert len(calls) == 2 + 3 * 4
    events = []   # a device's synchronize closes each block before its clock stops
    seconds_per_call(lambda: events.append("call"), warmup=1, blocks=2, per_block=2,
                     sync=lambda: events.append("sync"))
    assert events == ["call"] + ["sync", "call", "call", "sync"] * 2


def test_a_variant_runs_in_its_own_process():
    """benchmark.processes.alternate: a variant runs in its own process and reports its
    seconds (compiled.py's eager tagger step)."""
    from fusedrnn.benchmark.processes import alternate
    times = alternate("fusedrnn.benchmark.compiled", ("eager",), 1, "tagger")
    assert list(times) == ["eager"] and len(times["eager"]) == 1 and times["eager"][0] > 0


def test_a_ceiling_this_cpu_cannot_run_is_listed_not_fatal(monkeypatch):
    # oneDNN's bfloat16 Linear raises on a CPU without AVX-512 (Zen 3): the run goes on
    # with the libraries that ran, and the header names the one that could not
    mkldnn = pytest.importorskip("torch.utils.mkldnn")
    from fusedrnn.benchmark.runner import Device
    from fusedrnn.benchmark.worker import gemm_ceilings

    def refuse(module, dtype):
        def call(x):
            raise RuntimeError("mkldnn_linear: bf16 path needs the cpu support avx512bw")
        return call
    monkeypatch.setattr(mkldnn, "to_mkldnn", refuse)
    found = gemm_ceilings(Device("cpu"), repeats=1, n=64)
    assert set(found) == {"float32", "float64", "bfloat16"}
    assert set(gemm_ceilings(Device("cpu"), repeats=1, n=64, dtypes=("float64",))) == {"float64"}
    for dtype in ("float32", "bfloat16"):
        assert found[dtype]["unavailable"] == {
            "oneDNN": "mkldnn_linear: bf16 path needs the cpu support avx512bw"}
        assert found[dtype]["by"] == "torch.mm" or dtype == "float32"
        assert found[dtype]["best"] == max(v for k, v in found[dtype].items()
                                           if k not in ("best", "by", "unavailable"))
    line = next(x for x in report.ceiling_lines(found) if "bfloat16" in x)
    assert "oneDNN unavailable" in line and "torch.mm" in line


def test_a_slow_library_is_timed_by_its_first_call(monkeypatch):
    # (torch's bfloat16 mm without AVX512-BF16 took most of a minute a call): one call each
    from fusedrnn.benchmark import worker
    from fusedrnn.benchmark.runner import Device

    device, calls = Device("cpu"), []
    real = device.time
    monkeypatch.setattr(device, "time", lambda fn: calls.append(1) or real(fn))
    monkeypatch.setattr(worker, "SLOW_S", 0.0)
    found = worker.gemm_ceilings(device, repeats=3, n=32, dtypes=("float64",))
    assert len(calls) == len(found["float64"]) - 2   # (less best and by: one call a library)
    monkeypatch.setattr(worker, "SLOW_S", 1e9)
    calls.clear()
    found = worker.gemm_ceilings(device, repeats=3, n=32, dtypes=("float64",))
    assert len(calls) == 4 * (len(found["float64"]) - 2)   # (the warm-up and 3 repeats)


def test_a_dtype_no_library_could_run_has_no_ceiling():
    line, = report.ceiling_lines({"bfloat16": {"unavailable": {"oneDNN": "needs avx512"},
                                               "best": None, "by": None}})
    assert line == "GEMM ceiling bfloat16 (same run): none (oneDNN unavailable)"
