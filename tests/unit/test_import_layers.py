"""The package's import graph, counting imports inside functions (the kernels' lazy imports of their ``@triton.jit``
modules among them): imports point down the layers of docs/architecture.md (``plugins -> report -> export,
checkpoint, distill -> quantization -> kernels -> numerics``, with ``launch``, ``interrupt`` and ``progress`` beside
``numerics``; inside ``plugins``, ``cli`` above ``megatron`` above ``megatron_cpu``), the kernels import
``numerics`` alone of the project, the core never imports ``modelopt_moe.plugins``, every imported project module
exists, and no module imports itself back through others."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Where each package's sources live in the checkout (pyproject.toml's package-dir).
SOURCES = {"modelopt_moe": REPO / "modelopt_moe", "modelopt_moe.plugins": REPO / "plugins"}

LAYERS = {  # the first matching prefix gives a module's layer; higher may import lower or equal
    "modelopt_moe.plugins.cli": 8,
    "modelopt_moe.plugins": 7,
    "modelopt_moe.plugins.megatron_cpu": 6,
    "modelopt_moe.report": 5,
    "modelopt_moe.export": 4,
    "modelopt_moe.checkpoint": 4,
    "modelopt_moe.distill": 4,
    "modelopt_moe.quantization": 3,
    "modelopt_moe.kernels": 2,
    "modelopt_moe.numerics": 1,
    "modelopt_moe.launch": 1,
    "modelopt_moe.interrupt": 1,
    "modelopt_moe.progress": 1,
}


def _modules() -> dict[str, Path]:
    found = {}
    for package, root in SOURCES.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if package == "modelopt_moe" and parts and parts[0] == "plugins":
                continue
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module ``name`` (a module, or an attribute of one) stands for."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> tuple[set[str], set[str]]:
    """(the project modules ``module`` imports, the names it imports as modules that are none of the project's)."""
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    found, unknown = set(), set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names, as_modules = [a.name for a in node.names], [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = f"{base}.{node.module}" if node.level and node.module else (node.module or base)
            # `from a import b`: module a, and b if it is a module; `from . import b`: module b.
            names = ([target] if node.module is not None else []) + [f"{target}.{a.name}" for a in node.names]
            as_modules = [target] if node.module is not None else names
        else:
            continue
        unknown.update(n for n in as_modules if n.startswith("modelopt_moe") and n not in MODULES)
        for name in names:
            if name.startswith("modelopt_moe"):
                resolved = _resolve(name)
                if resolved is not None and resolved != module:
                    found.add(resolved)
    return found, unknown


_PARSED = {module: _imports(module, path) for module, path in MODULES.items()}
GRAPH = {module: found for module, (found, _) in _PARSED.items()}


def _layer(module: str) -> int | None:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return LAYERS[prefix]
    return None


def test_every_module_has_a_layer():
    assert sorted(m for m in MODULES if m != "modelopt_moe" and _layer(m) is None) == []


def _is_package_of(dep: str, module: str) -> bool:
    """Importing a module imports its packages' ``__init__``: those edges are not a layer question."""
    return module.startswith(dep + ".")


def test_imports_point_down_the_layers():
    upward = sorted(f"{mod} (layer {_layer(mod)}) imports {dep} (layer {_layer(dep)})"
                    for mod, deps in GRAPH.items() for dep in deps
                    if mod != "modelopt_moe" and dep != "modelopt_moe" and not _is_package_of(dep, mod)
                    and _layer(dep) > _layer(mod))
    assert upward == []


def test_every_imported_project_module_exists():
    assert sorted((mod, name) for mod, (_, unknown) in _PARSED.items() for name in unknown) == []


def test_kernels_import_only_numerics_of_the_project():
    kernels = {mod: deps for mod, deps in GRAPH.items() if mod.startswith("modelopt_moe.kernels")}
    assert sorted((mod, dep) for mod, deps in kernels.items() for dep in deps
                  if not dep.startswith(("modelopt_moe.kernels", "modelopt_moe.numerics"))) == []


def test_the_core_never_imports_the_plugins():
    core = {mod: deps for mod, deps in GRAPH.items() if not mod.startswith("modelopt_moe.plugins")}
    found = sorted((mod, dep) for mod, deps in core.items() for dep in deps if dep.startswith("modelopt_moe.plugins"))
    assert found == []


@pytest.mark.parametrize("start", sorted(GRAPH))
def test_no_module_imports_itself_back(start):
    # A package's __init__ importing its own submodules is how packages gather their names, not a cycle.
    def deps(mod):
        return {d for d in GRAPH[mod] if not _is_package_of(d, mod)}

    seen, stack = set(), [(start, (start,))]
    while stack:
        mod, path = stack.pop()
        for dep in deps(mod):
            if dep == start:
                pytest.fail("import cycle: " + " -> ".join((*path, dep)))
            if dep not in seen:
                seen.add(dep)
                stack.append((dep, (*path, dep)))
