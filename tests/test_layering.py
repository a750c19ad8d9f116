"""The package's modules import each other in layers, without cycles (issue 22).

Read from the source with `ast`, not by importing: every import counts, at a module's
top and inside functions alike (a function-level import is still a dependency; it only
runs later). Relative imports are resolved; `from pkg import name` is an import of the
submodule pkg.name where there is one, else of pkg, and importing a package is
importing its __init__. Only fusedrnn.* modules are nodes.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "fusedrnn"

# The intended layering, bottom up: config (cell table, options, flags) <- layout <-
# validate <- recurrence <- backends (cpu/, gpu/) <- op <- torch/, precompile; inside cpu/, lowlevel/
# (the kernels' building blocks) under the rest. A module under a key (the key itself or
# its submodules) imports only modules under the names listed; the longest key decides.
# The facade (fusedrnn/__init__.py), __main__ and benchmark/ sit on top: no rule but no
# cycle.
CORE = ("fusedrnn.config", "fusedrnn.layout", "fusedrnn.validate", "fusedrnn.recurrence")
LAYERS = {
    "fusedrnn.config": (),
    "fusedrnn.cache": (),
    "fusedrnn.layout": ("fusedrnn.config",),
    "fusedrnn.validate": ("fusedrnn.config", "fusedrnn.layout"),
    "fusedrnn.recurrence": ("fusedrnn.config", "fusedrnn.layout", "fusedrnn.validate"),
    "fusedrnn.cpu": CORE + ("fusedrnn.cpu",),
    "fusedrnn.cpu.lowlevel": ("fusedrnn.cpu.lowlevel", "fusedrnn.cpu.threads"),
    "fusedrnn.gpu": CORE + ("fusedrnn.gpu",),
    "fusedrnn.op": CORE + ("fusedrnn.cache", "fusedrnn.cpu", "fusedrnn.gpu"),
    "fusedrnn.torch": CORE + ("fusedrnn.op", "fusedrnn.torch"),
    # drives the op to compile the CPU's kernels (cpu/warm.py starts it as a process)
    "fusedrnn.precompile": CORE + ("fusedrnn.op", "fusedrnn.cpu"),
}


def _under(module, name):
    return module == name or module.startswith(name + ".")


def _modules():
    """{module name: (path, is_package)} for every .py file of the package."""
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _imports(name, path, is_package, modules):
    """{imported fusedrnn module: [line numbers]} of one module."""
    package = name if is_package else name.rpartition(".")[0]
    found = {}
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - (node.level - 1)] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # a name inside a module, or not ours
                target = target.rpartition(".")[0]
            if target and target != name and node.lineno not in found.get(target, []):
                found.setdefault(target, []).append(node.lineno)
    return found


MODULES = _modules()
GRAPH = {name: _imports(name, path, is_package, MODULES)
         for name, (path, is_package) in MODULES.items()}


def _where(module, target):
    lines = ", ".join(str(n) for n in GRAPH[module][target])
    return f"{module} -> {target} ({MODULES[module][0].relative_to(PACKAGE_DIR.parent)}:{lines})"


def _reachable(starts):
    seen, todo = set(), list(starts)
    while todo:
        for target in GRAPH[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def _strongly_connected():
    """Tarjan's components of GRAPH with more than one module (each holds a cycle)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def _edges_among(component):
    """Every import between the component's modules: its cycles, with their lines."""
    return [_where(a, b) for a in sorted(component) for b in sorted(GRAPH[a]) if b in component]


def test_the_graph_sees_function_level_and_relative_imports():
    # Edges that must be found, or the tests below would pass on an empty graph.
    for module, target in [("fusedrnn.op", "fusedrnn.cpu"),           # in a function
                           ("fusedrnn.op", "fusedrnn.gpu"),
                           ("fusedrnn.cpu", "fusedrnn.cpu.jitcache"),  # from . import x
                           ("fusedrnn.cpu.units", "fusedrnn.cpu.lowlevel"),
                           ("fusedrnn.cpu.lowlevel", "fusedrnn.cpu.lowlevel.packing"),
                           ("fusedrnn.validate", "fusedrnn.layout"),
                           ("fusedrnn.torch.modules", "fusedrnn.layout"),
                           ("fusedrnn.benchmark.peers", "fusedrnn.torch")]:  # import a.b as c
        assert target in GRAPH[module], (module, target, sorted(GRAPH[module]))
    assert "fusedrnn" in MODULES and "fusedrnn.torch" in MODULES


def test_no_import_cycles():
    cycles = _strongly_connected()
    assert not cycles, "import cycles:\n" + "\n".join(
        f"  among {', '.join(sorted(c))}:\n    " + "\n    ".join(_edges_among(c)) for c in cycles)


@pytest.mark.parametrize("module", [m for m in sorted(MODULES)
                                    if any(_under(m, key) for key in LAYERS)])
def test_imports_follow_the_layers(module):
    allowed = LAYERS[max((key for key in LAYERS if _under(module, key)), key=len)]
    wrong = [_where(module, t) for t in sorted(GRAPH[module])
             if not any(_under(t, name) for name in allowed)]
    assert not wrong, f"{module} may import only {allowed or 'no fusedrnn module'}:\n" + \
        "\n".join(wrong)


def test_lowlevel_is_imported_through_its_entry_only():
    """Outside fusedrnn.cpu.lowlevel, only its __init__ (the narrow entry) is imported."""
    wrong = [_where(m, t) for m in sorted(GRAPH) if not _under(m, "fusedrnn.cpu.lowlevel")
             for t in sorted(GRAPH[m]) if _under(t, "fusedrnn.cpu.lowlevel")
             and t != "fusedrnn.cpu.lowlevel"]
    assert not wrong, "import fusedrnn.cpu.lowlevel, not its submodules:\n" + "\n".join(wrong)


def test_op_does_not_reach_the_torch_integration():
    # op hands torch tensors to whatever fusedrnn.torch registered (op.register_array_type).
    reached = _reachable(["fusedrnn.op"])
    assert not [m for m in reached if _under(m, "fusedrnn.torch")], sorted(reached)


def test_backends_reach_neither_op_nor_torch():
    backends = [m for m in MODULES if _under(m, "fusedrnn.cpu") or _under(m, "fusedrnn.gpu")]
    for module in backends:
        above = [m for m in _reachable([module])
                 if m == "fusedrnn" or _under(m, "fusedrnn.op") or _under(m, "fusedrnn.torch")]
        assert not above, (module, above)


def test_jit_cache_hashes_every_file_the_cpu_kernels_import():
    """jitcache.DEPENDENCIES is exactly cpu/*.py and the package files they import, directly
    or not: a cached kernel may compile in their code or constants."""
    from fusedrnn.cpu import jitcache
    root = Path(jitcache.__file__).resolve().parent.parent
    cpu = [m for m in MODULES if _under(m, "fusedrnn.cpu")]
    needed = {str(MODULES[m][0].relative_to(PACKAGE_DIR)) for m in set(cpu) | _reachable(cpu)}
    hashed = {str(Path(p).resolve().relative_to(root)) for p in jitcache.DEPENDENCIES}
    assert hashed == needed
