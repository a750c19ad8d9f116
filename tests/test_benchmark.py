"""The benchmark CLI in its smallest mode: the table's structure, and every number in it
(and in the JSON) finite and positive. No timing is asserted."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fusedrnn.benchmark import cases as case_lib

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    done = subprocess.run(
        [sys.executable, "-m", "fusedrnn", "bench", "--quick", "--repeats", "1",
         "--cases", "design-doc,seq2seq,cold", "--json", str(out / "r.json"),
         "--plot", str(out / "r.png")],
        capture_output=True, text=True, cwd=out, env=ENV, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout, json.loads((out / "r.json").read_text())


def test_table_structure_and_numbers(quick_run):
    stdout, _ = quick_run
    rows = [line for line in stdout.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header[:6] == ["case", "unit", "fusedrnn", "torch", "naive", "naive-hoisted"]
    assert header[-2:] == ["GFLOP/s", "% of GEMM"]
    expected = [c for c in case_lib.cases(["design-doc", "seq2seq"], quick=True)]
    body = rows[1:]
    assert len(body) == len(expected)
    for row, case in zip(body, expected):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == len(header) and cells[0] == case.name
        numbers = [float(x) for cell in cells[2:] if cell != "n/a"
                   for x in NUMBER.findall(cell)]
        assert numbers and all(math.isfinite(x) and x > 0 for x in numbers), row
        # only the naive loops may lack a figure (they have no backward)
        assert ("n/a" in cells) == case.train
    assert re.search(r"Cold start .* import \+ first call \d+\.\d+ s", stdout)
    assert "GEMM ceiling (float32, same run):" in stdout


def test_json_has_every_case_with_positive_times(quick_run):
    _, doc = quick_run
    assert doc["gemm_ceiling_gflops"] > 0 and doc["cpu_count"] >= 1
    assert len(doc["cases"]) == len(case_lib.cases(["design-doc", "seq2seq", "cold"], quick=True))
    for case in doc["cases"]:
        assert "fusedrnn" in case["seconds"]
        for stats in case["seconds"].values():
            values = [stats["median"], stats["min"], stats["max"]]
            assert all(math.isfinite(v) and v > 0 for v in values)
            assert stats["min"] <= stats["median"] <= stats["max"]


def test_unknown_group_is_refused():
    done = subprocess.run([sys.executable, "-m", "fusedrnn", "bench", "--cases", "nope"],
                          capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert done.returncode == 2 and "unknown case groups" in done.stderr
