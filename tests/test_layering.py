"""The package's layers point one way, read from the source with ``ast`` (imports inside functions count too).

Floors, lowest first: the data and math (``models``, ``workflow``, ``plan``, ``algorithms``, ``data``) know
nothing of Ray or torch.distributed (the rollout engine does: it loads weights into tensor-parallel models); ``parallel`` applies parallelism to plain models; ``engine`` builds a role on a process;
``planner`` reads plans and prices them; ``runtime`` executes schedules; ``train`` drives an executor; the CLI
sits on top. Imports under ``if TYPE_CHECKING:`` never run and are left out: they name types only.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "loomrl"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The loomrl module an imported name lives in (a package's ``__init__`` for its re-exports)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _executed_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _imports(module: str) -> set[str]:
    """Every absolute module name ``module`` imports (loomrl's and others'), resolved to modules."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in _executed_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:  # `from pkg import module` imports the module
                full = f"{base}.{alias.name}"
                out.add(full if full in MODULES else base)
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for module in MODULES:
        for name in _imports(module):
            target = _resolve(name) if name.startswith("loomrl") else None
            if target is not None and target != module:
                graph[module].add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as a closed path of modules, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def _offenders(packages: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    """``module imports name`` for every import of a ``forbidden`` prefix by a module of ``packages``."""
    bad = []
    for module in sorted(MODULES):
        if module.split(".")[1:2] and module.split(".")[1] in packages:
            for name in sorted(_imports(module)):
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    bad.append(f"{module} imports {name}")
    return bad


def test_the_reader_sees_every_module_and_its_imports():
    assert {"loomrl.plan.schedule", "loomrl.runtime.worker", "loomrl.planner.simulation.simulator"} <= set(MODULES)
    assert "loomrl.plan.schedule" in _graph()["loomrl.planner.simulation.simulator"]
    assert "torch.distributed" in _imports("loomrl.parallel.allocations")


def test_no_import_cycles_between_modules():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_data_and_math_know_nothing_of_ray_or_torch_distributed():
    assert _offenders(("models", "workflow", "plan", "algorithms", "data"), ("ray", "torch.distributed")) == []


def test_the_planner_does_not_reach_into_the_runtime_or_the_trainer():
    assert _offenders(("planner",), ("loomrl.runtime", "loomrl.train", "ray")) == []


def test_the_runtime_and_the_engine_do_not_reach_into_the_trainer():
    assert _offenders(("runtime", "engine", "parallel"), ("loomrl.train", "loomrl.cli")) == []
    assert _offenders(("engine", "parallel"), ("loomrl.runtime",)) == []


def test_ops_run_models_only_through_their_engine():
    assert _offenders(("algorithms",), ("loomrl.parallel", "loomrl.role", "loomrl.runtime")) == []
