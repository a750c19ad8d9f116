"""The README: its commands are the ones CI runs, its install commands name extras that exist,
its numpy example runs, it is short, and its sections come in a newcomer's order.
(tests/test_docs.py runs every code block of the README and docs/.)"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAX_WORDS = 1200
INSTALL = re.compile(r"python -m pip install -e (?:\.|'\.\[(\w+)\]')")


def _bash_blocks():
    return [[line for line in block.splitlines() if line.strip() and not line.startswith("#")]
            for block in re.findall(r"```bash\n(.*?)```", README, re.S)]


def test_ci_runs_the_readme_test_command():
    commands = _bash_blocks()[0]
    assert len(commands) == 2
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci.splitlines()


@pytest.mark.exhaustive
@pytest.mark.xdist_group("fresh-compile")
def test_ci_groups_keep_their_tests_on_one_worker(request):
    """.ci/run's exhaustive tier (--dist loadgroup): a grouped test's id carries its group,
    xdist's channel to its scheduler. With pytest 9.2 it silently did not (pytest-xdist
    issue 1386; pyproject's test extra keeps pytest below), and each worker compiled the
    fresh-compile group's kernels again. It reads xdist's suffix, its channel today: an
    xdist that carries groups another way fails it, and then this test needs rewriting."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("runs under pytest-xdist's --dist loadgroup (.ci/run's exhaustive tier)")
    assert request.node.nodeid.endswith("@fresh-compile"), request.node.nodeid


def test_install_commands_name_existing_extras():
    """The Install section's commands are `python -m pip install -e .` or `-e '.[extra]'` with
    an extra pyproject.toml defines, the form .ci/run installs the test extra with."""
    section = README.split("## Install", 1)[1].split("\n## ", 1)[0]
    commands = [c for block in re.findall(r"```bash\n(.*?)```", section, re.S)
                for c in block.splitlines() if c.strip() and not c.startswith("#")]
    # (the keys of pyproject's [project.optional-dependencies]; no tomllib before 3.11)
    table = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
    extras = re.findall(r"^(\w+) = ", table.split("\n[", 1)[0], re.M)
    assert commands
    for command in commands:
        match = INSTALL.fullmatch(command)
        assert match, command
        assert match.group(1) is None or match.group(1) in extras, command
    assert "python -m pip install -e '.[test]'" in (ROOT / ".ci" / "run").read_text()


def test_usage_example_runs():
    example = re.search(r"### numpy\n\n```python\n(.*?)```", README, re.S).group(1)
    namespace = {}
    exec(compile(example, "README numpy example", "exec"), namespace)  # noqa: S102
    grads = namespace["grads"]
    assert grads.parameters.shape == namespace["params"].shape


def test_readme_is_short():
    """At most MAX_WORDS words, counting everything: prose, tables and code blocks alike. A
    word is a whitespace-separated token holding a letter or a digit (a table's `|` and
    `---` are not words)."""
    words = [token for token in README.split() if re.search(r"[A-Za-z0-9]", token)]
    assert len(words) <= MAX_WORDS, f"README.md has {len(words)} words, at most {MAX_WORDS}"


def test_readme_order():
    """The two commands first, then install, examples, features and performance, before
    anything else: a newcomer reaches the performance table without passing internals."""
    headings = re.findall(r"^## (.+)$", README, re.M)
    assert headings[:4] == ["Install", "Examples", "Features", "Performance"], headings
    assert README.index("```bash") < README.index("## Install")
    before_performance = README.split("## Performance", 1)[0].lower()
    for internal in ("threading layer", "fork", "workqueue", "openmp", "persistent kernel"):
        assert internal not in before_performance, internal
