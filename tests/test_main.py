"""`python -m fusedrnn demo`: one small float64 training step per mode, compared with
torch.nn by the CLI itself (it returns 1 when outputs or gradients differ past 1e-9)."""
import pytest

from fusedrnn.__main__ import main

from conftest import CELLS, MODES


@pytest.mark.parametrize("mode", MODES)
def test_demo_matches_torch(mode, capsys):
    assert main(["demo", "--mode", mode, "--bidirectional"]) == 0
    printed = capsys.readouterr().out
    assert f"nn.{CELLS[mode].torch_class}: max |out diff|" in printed
