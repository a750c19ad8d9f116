"""Data-parallel training on torch.distributed: 2 processes, gloo, on the CPU, through
the shipped example. Ranks end bit-identical and equal to one process on the full batch."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ddp_two_processes_match_single_process():
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "ddp_train.py"), "--check",
                           "--world-size", "2", "--steps", "5"],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "max |rank0 - other ranks| = 0.0e+00" in done.stdout
