"""fusedrnn/benchmark/machine.py: the machine constants, measured and written."""
import json
import os
import platform

from fusedrnn.benchmark import machine


def test_writes_every_constant(tmp_path, capsys):
    out = tmp_path / "machine.json"
    machine.main(["--repeats", "10", "--json", str(out)])
    got = json.loads(out.read_text())
    workqueue = got["launch_us"]["workqueue"]   # Numba's own layer: always there
    assert workqueue["layer"] == "workqueue"
    for timing in (workqueue["back_to_back"], workqueue["after_idle"]):
        assert 0 < timing["p10"] <= timing["median"]
    assert got["core_gflops"]["microkernel"] > 0 and got["core_gflops"]["numpy"] > 0
    assert got["serial_bound"]["workqueue"] > 0
    if platform.system() == "Linux" and os.path.isdir("/sys/devices/system/cpu/cpu0/cache"):
        assert got["l2_bytes"] >= 1 << 16
    printed = capsys.readouterr().out
    assert "launch workqueue: back to back" in printed and "micro-kernel" in printed


def test_a_layer_that_cannot_start_reads_none():
    assert machine.launch_us("no-such-layer", 3) is None
