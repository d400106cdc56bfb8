"""The package reads top-down (docs/structures.md, "Layers"): each part imports only parts of the
layers below it (or itself), commands (``tools/``) sit on top, nothing imports the hook table
(``plugin.py``), and no import cycle exists outside ``TYPE_CHECKING``. Read from the source
with ``ast``: what a module imports at run time, wherever in the module the import is."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "sglang_eaas"

# Bottom up. A part is a top-level module or subpackage of sglang_eaas.
LAYERS = (
    # records, parsing and the machine: nothing of the project's below them
    {"envs", "addresses", "holdings", "model_info", "corpus", "training", "transports", "dealing",
     "request_checks", "refusal", "benchmark_plugins", "shm_files"},
    # wire records (protocol/), placement files, stock SGLang on a CPU
    {"placement", "checkpoint", "protocol", "cpu_runtime", "slices"},
    {"routing_table", "endpoint"},
    {"esft", "balance", "membership"},  # policies over Holdings; reaching a monitor
    {"elastic"},  # resizing the live tier (over balance's apply and a monitor)
    {"controller"},  # the tier controller: every change as one operation (over elastic)
    {"config"},  # the --eaas options and their record, checked before anything starts
    {"cores"},
    {"client", "expert_server", "monitor", "status"},  # the processes' roles, side by side
    {"launcher"},
    {"plugin"},  # the hook table: on top of everything it hooks
    {"tools", "deploy"},  # commands (deploy: a whole local deployment)
    {"plan"},  # the capacity planner: over everything, its configs checked by deploy's checks
)
LEVEL = {part: i for i, layer in enumerate(LAYERS) for part in layer}
ROOT = "sglang_eaas"  # the package's __init__: on top, it exports sglang_eaas.Engine lazily


def _level(module: str) -> int:
    return len(LAYERS) if module == ROOT else LEVEL[_part(module)]


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """The project's modules ``path`` imports outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                   for node in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang_eaas"):
            for alias in node.names:  # "from sglang_eaas import envs" imports a module
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("sglang_eaas")}
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    return {m: _runtime_imports(p, set(files)) for m, p in files.items()}


def _part(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def test_every_part_is_in_a_layer():
    parts = {_part(m) for m in _graph()} - {"sglang_eaas"}
    assert parts == set(LEVEL), f"not in LAYERS: {parts - set(LEVEL)}; gone: {set(LEVEL) - parts}"


def test_each_part_imports_only_the_layers_below_it():
    wrong = sorted(f"{m} imports {i}" for m, imports in _graph().items() for i in imports
                   if _part(i) != _part(m) and _part(i) != "sglang_eaas"
                   and LEVEL[_part(i)] >= _level(m))
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join(
                    path[path.index(target):] + [module, target]))
            if target not in state:
                visit(target, path + [module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_the_checker_sees_what_it_must(tmp_path):
    """Not vacuous: a lazy import in a function counts, one under TYPE_CHECKING does not."""
    source = tmp_path / "probe.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from sglang_eaas.client.client import EaasClient\n"
                      "def f():\n    from sglang_eaas import plugin\n")
    modules = {"sglang_eaas.plugin", "sglang_eaas.client.client"}
    assert _runtime_imports(source, modules) == {"sglang_eaas.plugin"}
