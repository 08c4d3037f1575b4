"""The package's import graph: no circle (imports inside functions included), and layers that only look down
(imports under ``TYPE_CHECKING`` included: a type-only import of a higher layer is a design edge too)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "lightning_ultrascale"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(path: Path, modules: dict[str, Path], typing: bool = False) -> set[str]:
    """The package's modules ``path`` imports, at the top or inside a function (under TYPE_CHECKING if ``typing``)."""
    tree = ast.parse(path.read_text())
    typing_only = set() if typing else {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }  # fmt: skip
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name.startswith("lightning_ultrascale"):
                found.add(name)
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle_even_through_imports_inside_functions():
    # An import moved into a function to dodge a circle still makes one: counted here as if at the
    # top. (A package importing its own submodules is not a circle: Python runs the package first.)
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert _circles(graph) == []


def test_the_check_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


#: The package's layers, lowest first (by the first name under ``lightning_ultrascale``): a module imports
#: its own layer and those below, never one above. A new top-level module or package must be placed here.
LAYERS: list[set[str]] = [
    {"errors", "utils"},  # the error types; tensors, collectives, memory accounting
    {"kernels"},  # reference, Triton and CUDA kernels, FP8 quantisation numerics
    {"data", "models"},  # corpora and datamodules; model families, the model contract, HF translation
    {"parallel"},  # the plugins: DP/ZeRO, TP, PP, CP, EP, recomputation; mesh and layout
    {"fp8"},  # FP8 training: the module swap and the precision plugin (over the parallel layout)
    {"core"},  # the Trainer and Fabric strategies, composition, checkpoints, guard, watchdog
    {"training"},  # LightningModules, callbacks, run services (stragglers, preemption, profiling)
    {"plan"},  # the planner and cost model (it builds strategies)
    {"cli", "testing"},  # command lines; test harnesses for users' own tests and benchmarks
    {"__init__"},  # the package itself: the public API
]


def _layer(module: str) -> int:
    parts = module.split(".")
    group = parts[1] if len(parts) > 1 else "__init__"
    found = [i for i, names in enumerate(LAYERS) if group in names]
    assert found, f"{module}: {group!r} is in no layer of LAYERS (place it there)"
    return found[0]


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if _layer(b) > _layer(a))


def test_no_module_imports_a_module_of_a_higher_layer():
    modules = _modules()
    graph = {name: _imports(path, modules, typing=True) - {name} for name, path in modules.items()}
    assert _upward_imports(graph) == []


def test_the_layer_check_finds_an_upward_import_even_a_type_only_one(tmp_path):
    # core/strategy.py importing the training side (here under TYPE_CHECKING) is what the layers forbid.
    module = tmp_path / "strategy.py"
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from {} import LlamaModule\n"
    module.write_text(typed.format("lightning_ultrascale.training.module"))
    modules = {**_modules(), "lightning_ultrascale.core.strategy": module}
    found = _imports(module, modules, typing=True)
    assert _upward_imports({"lightning_ultrascale.core.strategy": found}) == [
        "lightning_ultrascale.core.strategy -> lightning_ultrascale.training.module"
    ]
    assert _imports(module, modules) == set()  # (the circle check does not count it)


def test_the_llama_family_does_not_import_the_deepseek_family():
    # The decoder's MLA lives in models/common/mla.py, beside the other attention.
    modules = _modules()
    llama = [name for name in modules if name.startswith("lightning_ultrascale.models.llama")]
    found = {f"{a} -> {b}" for a in llama for b in _imports(modules[a], modules, typing=True)}
    assert sorted(b for b in found if "lightning_ultrascale.models.deepseek" in b) == []


def test_a_family_imports_no_other_family_and_the_shared_code_none():
    # A family is one folder (models/<family>/) over models/common/: adding or removing one touches no other.
    from lightning_ultrascale.models import FAMILIES

    families = {family.__name__ for family in FAMILIES}
    modules = _modules()

    def family_of(name: str) -> str | None:
        return next((f for f in families if name == f or name.startswith(f"{f}.")), None)

    crossing = []
    for name, path in modules.items():
        mine = family_of(name)
        if mine is None and not name.startswith("lightning_ultrascale.models.common"):
            continue
        for imported in _imports(path, modules, typing=True):
            theirs = family_of(imported)
            if theirs is not None and theirs != mine:
                crossing.append(f"{name} -> {imported}")
    assert len(families) >= 3 and sorted(crossing) == []
