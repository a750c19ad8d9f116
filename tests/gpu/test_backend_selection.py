"""Backend selection without a GPU: CuPy is imported lazily, only for CuPy arrays."""
import subprocess
import sys


def test_import_fusedrnn_does_not_import_cupy():
    code = ("import sys, numpy as np, fusedrnn\n"
            "n = fusedrnn.param_size(mode='gru', input_size=2, state_size=3)\n"
            "fusedrnn.RNN(np.ones((2, 1, 2)), np.ones(n), state_size=3, num_layers=1, mode='gru')\n"
            "assert 'cupy' not in sys.modules, 'cupy was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
