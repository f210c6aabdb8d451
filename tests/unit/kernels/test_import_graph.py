"""``modelopt_moe.kernels`` imports ``modelopt_moe.numerics`` alone of the project, and its modules import each other
without a cycle, counting imports inside functions (the lazy imports of the ``@triton.jit`` modules) too."""

import ast
from pathlib import Path

import modelopt_moe.kernels

PACKAGE = "modelopt_moe.kernels"
ROOT = Path(modelopt_moe.kernels.__file__).parent


def _imports(path: Path) -> set[str]:
    """Every project module that ``path`` imports, anywhere in the file, as a dotted name."""
    module = f"{PACKAGE}.{path.stem}" if path.stem != "__init__" else PACKAGE
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = f"{base}.{node.module}" if node.level and node.module else (node.module or base)
            # `from . import x` names a module; `from .x import y` names a module's attribute.
            names = [f"{target}.{a.name}" for a in node.names] if node.module is None else [target]
            found.update(names)
    return {name for name in found if name.startswith("modelopt_moe")}


def _graph() -> dict[str, set[str]]:
    return {f"{PACKAGE}.{p.stem}" if p.stem != "__init__" else PACKAGE: _imports(p) for p in ROOT.glob("*.py")}


def test_kernels_import_only_numerics_of_the_project():
    outside = {(mod, dep) for mod, deps in _graph().items() for dep in deps
               if not dep.startswith((PACKAGE + ".", "modelopt_moe.numerics")) and dep != PACKAGE}
    assert not outside


def test_kernel_modules_import_each_other_without_a_cycle():
    graph = {mod: {d for d in deps if d.startswith(PACKAGE)} for mod, deps in _graph().items()}
    assert all(dep in graph for deps in graph.values() for dep in deps), "an import names no kernels module"
    done, path = set(), []

    def visit(mod):
        assert mod not in path, f"import cycle: {' -> '.join([*path[path.index(mod):], mod])}"
        if mod in done:
            return
        path.append(mod)
        for dep in sorted(graph[mod]):
            visit(dep)
        path.pop()
        done.add(mod)

    for mod in sorted(graph):
        visit(mod)
