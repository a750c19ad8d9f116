"""README.md and docs/*.md stay true: every code block runs, every environment variable the
package reads is documented, and every link points somewhere.

Code blocks. A fenced block's info string says what it is, and nothing else is allowed (a
block either runs or is plain text):
- ```python      runs in a fresh subprocess: PYTHONPATH the repository root, cwd a temporary
                 directory, a timeout. FUSEDRNN_FIRST_TIER defaults to 0 there, as in the rest
                 of the suite (conftest.py): an uncached kernel set compiles in the block's
                 own process instead of starting a background compile that outlives it.
                 The blocks run two at a time (block_results), each test reads its own.
- ```python gpu  the same where CuPy sees a CUDA device; skipped otherwise, the reason naming
                 the file and the block.
- ```text output the exact stdout of the python block right before it.
- ```text        text that is not code (a signature).
- ```bash        each command (comments skipped, `\\` continuations joined) either runs here
                 (`python` as this interpreter, exit status 0), or is checked by
                 tests/test_readme.py (the README's first block, the install commands), or is
                 one of NOT_RUN below.

Environment variables. The package's reads are found in its source, not in its text: the key
of every `environ.get/setdefault/pop(...)`, `environ[...]`, `... in environ` and
`getenv(...)` in fusedrnn/**/*.py, resolved where it is a name (a module constant, or one
imported from another module), plus every string constant assigned to a name ending in ENV.
So the C preprocessor macros passed to NVRTC (`-DFUSEDRNN_PHASE_CLOCKS`, ...) do not count,
and a read whose key cannot be resolved fails the test instead of going unseen. Every
FUSEDRNN_* variable read must be a row of docs/gpu.md's table, with a default, and every row
a variable read; other variables the package reads must be mentioned somewhere in the docs
(except FORWARDED).

Also: relative links and their #anchors resolve, CHANGELOG.md has a section for
fusedrnn.__version__ (pyproject's), and docs/usage.md's signature is fusedrnn.RNN's.
"""
from __future__ import annotations

import ast
import inspect
import itertools
import os
import re
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import pytest

import fusedrnn

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGE = ROOT / "fusedrnn"
BLOCK_TIMEOUT_S = 300   # a cold Numba cache compiles a kernel set in the block's process
WORKERS = min(2, os.cpu_count() or 1)

KINDS = ("python", "python gpu", "text", "text output", "bash")
# Shell commands the docs show that do not run in a test, each with the reason.
NOT_RUN = {
    "python examples/ddp_train.py --check":
        "starts two training processes; tests/torch/test_ddp.py runs the example",
}
# Variables the package passes on without depending on them.
FORWARDED = {"PYTHONPATH": "the benchmark hands it on to its worker processes"}


# -- the blocks ------------------------------------------------------------------------------

@dataclass
class Block:
    path: Path
    line: int          # the opening fence's line, 1-based
    kind: str
    text: str
    output: str | None = None   # a ```text output block right after a python block
    commands: list = field(default_factory=list)

    @property
    def name(self):
        first = next((s.strip() for s in self.text.splitlines() if s.strip()), "")
        return f"{self.path.relative_to(ROOT)}:{self.line} {first[:48]}"


FENCE = re.compile(r"^```(.*)$")


def _blocks(path):
    blocks, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{path}:{start + 1}: unclosed code block"
        blocks.append(Block(path, start + 1, opening.group(1).strip(), "\n".join(body) + "\n"))
        i += 1
    for before, after in itertools.pairwise(blocks):
        if after.kind == "text output" and before.kind == "python":
            before.output = after.text
    return blocks


ALL_BLOCKS = [block for path in DOCS for block in _blocks(path)]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.kind in ("python", "python gpu")]


def _commands(text):
    """A bash block's commands: comment and blank lines dropped, continuations joined."""
    commands, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        commands.append(" ".join(current.split()))
        current = ""
    return commands


def _readme_checked():
    """The commands tests/test_readme.py checks against .ci/run and pyproject.toml: the
    README's first bash block and its install commands."""
    readme = [b for b in ALL_BLOCKS if b.path.name == "README.md" and b.kind == "bash"]
    checked = set(_commands(readme[0].text))
    return checked | {c for b in readme for c in _commands(b.text) if INSTALL.fullmatch(c)}


INSTALL = re.compile(r"python -m pip install -e (\.|'\.\[\w+\]')")
BASH_COMMANDS = [(b, c) for b in ALL_BLOCKS if b.kind == "bash" for c in _commands(b.text)]


@lru_cache(maxsize=1)
def _gpu():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:   # noqa: BLE001  (no CuPy, no driver, no device: all mean no GPU)
        return False


def _environment():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get(
        "PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("FUSEDRNN_FIRST_TIER", "0")
    return env


def test_every_block_is_of_a_known_kind():
    odd = [f"{b.path.relative_to(ROOT)}:{b.line} ```{b.kind}" for b in ALL_BLOCKS
           if b.kind not in KINDS]
    assert not odd, f"code blocks must be one of {KINDS} (runnable, or plain text): {odd}"
    orphans = [f"{b.path.relative_to(ROOT)}:{b.line}" for i, b in enumerate(ALL_BLOCKS)
               if b.kind == "text output" and (i == 0 or ALL_BLOCKS[i - 1].kind != "python"
                                                or ALL_BLOCKS[i - 1].path != b.path)]
    assert not orphans, f"a ```text output block must follow a python block: {orphans}"


def _run(block):
    """The block's subprocess result (or its TimeoutExpired), run in a temporary directory."""
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "block.py"
        script.write_text(block.text)
        try:
            return subprocess.run([sys.executable, str(script)], cwd=folder, check=False,
                                  env=_environment(), capture_output=True, text=True,
                                  timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired as expired:
            return expired


@pytest.fixture(scope="module")
def block_results(request):
    """Every selected python block's result, the blocks run WORKERS at a time: a block's time
    is mostly torch's import and Numba's cache load in one thread, so two at a time halve
    the wait on 2 cores."""
    selected = [item.callspec.params["block"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_python_block_runs"]
    runnable = [b for b in selected if b.kind == "python" or _gpu()]
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        futures = {b.name: pool.submit(_run, b) for b in runnable}
    return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.name)
def test_python_block_runs(block, block_results):
    if block.kind == "python gpu" and not _gpu():
        pytest.skip(f"{block.name}: needs a CUDA device (```python gpu)")
    result = block_results[block.name]
    assert not isinstance(result, subprocess.TimeoutExpired), \
        f"{block.name}: still running after {BLOCK_TIMEOUT_S} s"
    assert result.returncode == 0, (f"{block.name} failed:\n{block.text}\n"
                                    f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    if block.output is not None:
        assert result.stdout.rstrip() == block.output.rstrip(), \
            f"{block.name}: its ```text output block differs from what it prints"


@pytest.mark.parametrize("block,command", BASH_COMMANDS,
                         ids=[f"{b.path.relative_to(ROOT)}:{b.line} {c[:48]}"
                              for b, c in BASH_COMMANDS])
def test_shell_command_runs_or_is_listed(block, command, tmp_path):
    if command in _readme_checked():
        return   # tests/test_readme.py checks it against .ci/run and pyproject.toml
    if command in NOT_RUN:
        return
    argv = shlex.split(command)
    assert argv[0] == "python", (
        f"{block.name}: `{command}` neither runs here (a `python ...` command) nor is one of "
        f"NOT_RUN (add it there with the reason it cannot run in a test)")
    result = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, env=_environment(),
                            check=False, capture_output=True, text=True,
                            timeout=BLOCK_TIMEOUT_S)
    assert result.returncode == 0, f"`{command}`:\n{result.stdout}\n{result.stderr}"


def test_not_run_commands_are_all_in_the_docs():
    shown = {c for _, c in BASH_COMMANDS}
    assert set(NOT_RUN) <= shown, f"NOT_RUN lists commands no doc shows: {set(NOT_RUN) - shown}"


# -- environment variables -------------------------------------------------------------------

def _module_name(path):
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _package_modules():
    return {_module_name(p): (p, ast.parse(p.read_text())) for p in sorted(PACKAGE.rglob("*.py"))}


def _absolute(module, is_package, node):
    """The module an ImportFrom node imports from, absolute."""
    if not node.level:
        return node.module
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_environ(node):
    return (isinstance(node, ast.Name) and node.id == "environ") or \
        (isinstance(node, ast.Attribute) and node.attr == "environ")


def _env_keys(tree):
    """(key node, line) of every environment read or write in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr == "getenv" or (node.func.attr in ("get", "setdefault", "pop")
                                              and _is_environ(node.func.value)):
                yield node.args[0], node.lineno
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "getenv" and node.args:
            yield node.args[0], node.lineno
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            yield node.slice, node.lineno
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn))
                                                   for op in node.ops) and \
                _is_environ(node.comparators[0]):
            yield node.left, node.lineno


@lru_cache(maxsize=1)
def package_environment():
    """(names read, names assigned to *ENV constants, unresolved reads) over fusedrnn/."""
    modules = _package_modules()
    constants, imports = {}, {}
    for module, (path, tree) in modules.items():
        is_package = path.name == "__init__.py"
        constants[module] = {t.id: node.value.value for node in tree.body
                             if isinstance(node, ast.Assign)
                             and isinstance(node.value, ast.Constant)
                             and isinstance(node.value.value, str)
                             for t in node.targets if isinstance(t, ast.Name)}
        imports[module] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(module, is_package, node)
                for alias in node.names:
                    imports[module][alias.asname or alias.name] = (source, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    imports[module][alias.asname or alias.name] = (alias.name, None)

    def resolve(module, node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in constants[module]:
                return constants[module][node.id]
            source, name = imports[module].get(node.id, (None, None))
            return constants.get(source, {}).get(name)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            source, name = imports[module].get(node.value.id, (None, None))
            target = source if name is None else f"{source}.{name}"   # `from . import m`
            return constants.get(target, {}).get(node.attr)
        return None

    read, declared, unresolved = set(), set(), []
    for module, (path, tree) in modules.items():
        for key, line in _env_keys(tree):
            value = resolve(module, key)
            if value is None:
                unresolved.append(f"{path.relative_to(ROOT)}:{line}")
            else:
                read.add(value)
        declared |= {value for name, value in constants[module].items()
                     if name.endswith("ENV")}
    return read, declared, unresolved


def documented_variables():
    """docs/gpu.md's table: {variable: (default, effect)}."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and cells[0].startswith("`FUSEDRNN_"):
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def test_the_collector_tells_variables_from_macros():
    read, declared, unresolved = package_environment()
    assert not unresolved, (f"environment reads whose key is not a string constant or a "
                            f"module constant: {unresolved}")
    assert {"FUSEDRNN_FIRST_TIER", "FUSEDRNN_GPU_PERSISTENT", "GOMP_SPINCOUNT"} <= read
    # a macro the package passes to NVRTC, in its source but not an environment variable
    assert "-DFUSEDRNN_PHASE_CLOCKS" in (PACKAGE / "benchmark" / "gpu_phases.py").read_text()
    assert not any("PHASE_CLOCKS" in name for name in read | declared)


def test_every_variable_the_package_reads_is_in_the_table():
    read, declared, _ = package_environment()
    ours = {name for name in read | declared if name.startswith("FUSEDRNN_")}
    table = documented_variables()
    assert not ours - set(table), f"read by fusedrnn, not in docs/gpu.md: {ours - set(table)}"
    assert not set(table) - ours, f"in docs/gpu.md, read nowhere: {set(table) - ours}"
    for name, (default, effect) in table.items():
        assert default and effect, f"docs/gpu.md: {name} needs its default and its effect"


def test_other_variables_the_package_reads_are_mentioned():
    read, _, _ = package_environment()
    text = "\n".join(p.read_text() for p in DOCS)
    missing = {name for name in read if not name.startswith("FUSEDRNN_")
               and name not in FORWARDED and name not in text}
    assert not missing, f"read by fusedrnn, mentioned in no doc: {missing}"


def test_every_fusedrnn_name_in_the_docs_is_a_variable():
    read, declared, _ = package_environment()
    # (a wildcard such as FUSEDRNN_GPU_* names a family, not a variable)
    named = {m for p in DOCS for m in re.findall(r"FUSEDRNN_\w+(?![\w*])", p.read_text())}
    assert named <= read | declared, f"the docs name variables fusedrnn does not read: " \
                                     f"{named - read - declared}"


# -- links, version, signature ---------------------------------------------------------------

def _slug(heading):
    """GitHub's anchor for a heading."""
    heading = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return heading.replace(" ", "-")


def _anchors(path):
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {_slug(m) for m in re.findall(r"^#+ (.*)$", text, re.M)}


def test_links_point_to_files_and_headings():
    broken = []
    for path in DOCS:
        text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)|src=\"([^\"]+)\"", text):
            target = target[0] or target[1]
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if not resolved.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_changelog_has_the_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    # the version is written once, in fusedrnn/__init__.py: pyproject reads it from there
    assert re.search(r'^dynamic = \["version"\]', pyproject, re.M)
    assert 'version = { attr = "fusedrnn.__version__" }' in pyproject
    version = fusedrnn.__version__
    assert f"## [{version}]" in changelog and "## [Unreleased]" in changelog


def test_usage_states_the_signature():
    """docs/usage.md's signature block is fusedrnn.RNN's, argument for argument, defaults
    included (the private `_stored_as` left out)."""
    text = (ROOT / "docs" / "usage.md").read_text()
    shown = re.search(r"```text\nfusedrnn\.RNN\((.*?)\)\n```", text, re.S).group(1)
    expected = []
    for p in inspect.signature(fusedrnn.RNN).parameters.values():
        if p.name.startswith("_"):
            continue
        if p.kind is p.KEYWORD_ONLY and "*" not in expected:
            expected.append("*")
        expected.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    assert "".join(shown.split()).split(",") == expected
