"""The import graph runs one way: experiments -> kdtree_jax (the engine) -> pallas_kernels (the kernels) -> jax.
Inside experiments/, the kernel benchmark package (experiments.kernels) and the scripts share the benchmark helpers
(experiments.timing, experiments.run_record); the helpers import no script.

Read from the source (every import statement, also those inside functions), so a lazy import cannot hide a circle.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kdtree_jax", "pallas_kernels", "experiments")
HELPERS = ("experiments.timing", "experiments.run_record")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(path: pathlib.Path, modules) -> set[str]:
    """The project modules that `path` imports (`from pkg import mod` counts as mod when mod is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name in modules}


GRAPH = {name: _imports(path, _modules()) - {name} for name, path in _modules().items()}


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("pallas_kernels")))
def test_kernels_do_not_import_the_engine(module):
    engine = sorted(m for m in GRAPH[module] if m.startswith("kdtree_jax"))
    assert not engine, (f"{module} imports {engine}: pallas_kernels never imports the engine; move the contract it needs "
                        f"to the pallas_kernels side")


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith(("kdtree_jax", "pallas_kernels"))))
def test_the_engine_does_not_import_experiments(module):
    scripts = sorted(m for m in GRAPH[module] if m.startswith("experiments"))
    assert not scripts, f"{module} imports {scripts}: the engine and the kernels never import experiments/"


@pytest.mark.parametrize("module", HELPERS)
def test_benchmark_helpers_import_no_script(module):
    scripts = sorted(m for m in GRAPH[module] if m.startswith("experiments"))
    assert not scripts, f"{module} imports {scripts}: the shared benchmark helpers import no script or study"


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    stack: list[str] = []

    def visit(module):
        state[module] = 1
        stack.append(module)
        for dep in sorted(GRAPH[module]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


def test_the_graph_is_read():
    """The checks above see the edges they are about (a parser that found nothing would pass them vacuously)."""
    assert "pallas_kernels.ops" in GRAPH["kdtree_jax.decode"]
    assert "kdtree_jax.model.parallel" in GRAPH["kdtree_jax.model.moe"]
    assert "pallas_kernels.tree" in GRAPH["pallas_kernels.tree_build"]
    assert "experiments.kernels.kernels_attention" in GRAPH["experiments.kernels.bench_kernels"]
    assert "experiments.kernels.kernels_moe" in GRAPH["experiments.bench_expert_parallel"]
