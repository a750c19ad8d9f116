"""The README's commands are the ones CI runs, and its usage example runs."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _first_bash_block():
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_ci_runs_the_readme_test_command():
    commands = _first_bash_block()
    assert len(commands) == 2
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci.splitlines()


def test_usage_example_runs():
    example = re.search(r"## Usage\n\n```python\n(.*?)```", README, re.S).group(1)
    namespace = {}
    exec(compile(example, "README usage", "exec"), namespace)  # noqa: S102
    grads = namespace["grads"]
    assert grads.parameters.shape == namespace["params"].shape
