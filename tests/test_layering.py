"""The package's layers point one way, read from the source with ``ast`` (every import counts: inside functions,
under ``if TYPE_CHECKING:``, and a package's own ``__init__``).

Floors, lowest first: ``config`` (typed settings) and the data and math (``models``, ``workflow``, ``plan``,
``algorithms``, ``data``, ``envs``) know nothing of Ray or torch.distributed (the rollout engine does: it loads
weights into tensor-parallel models); ``parallel`` applies parallelism to plain models; ``role`` builds a role on a
process; ``checkpoint`` writes and reads a run's state; ``planner`` reads plans and prices them, in sub-packages of
one order; ``report`` draws runs (and asks the launcher, which reads the environment, how to reach a logging
service); ``runtime`` executes schedules; ``train`` drives an executor; ``commands`` and the CLI sit on top.
No module imports another module's private name.
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


def _import_nodes(module: str) -> list[tuple[str, ast.ImportFrom | ast.Import]]:
    """Every import statement of ``module`` (anywhere in it) with the absolute module it imports from."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[str, ast.ImportFrom | ast.Import]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            out.append((base, node))
    return out


def _imports(module: str) -> set[str]:
    """Every absolute module name ``module`` imports (loomrl's and others'), resolved to modules."""
    out: set[str] = set()
    for base, node in _import_nodes(module):
        if isinstance(node, ast.Import):
            out.add(base)
            continue
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
                return path[path.index(nxt) :] + [nxt]
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


def test_no_module_imports_its_own_packages_init():
    # a package's __init__ re-exports its modules for other packages: importing it from inside is a cycle
    inits = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    back = [
        f"{m} imports {t}" for m, targets in _graph().items() for t in targets if t in inits and m.startswith(t + ".")
    ]
    assert back == []


def test_data_and_math_know_nothing_of_ray_or_torch_distributed():
    assert (
        _offenders(("config", "models", "workflow", "plan", "algorithms", "data", "envs"), ("ray", "torch.distributed"))
        == []
    )


def test_the_plan_knows_nothing_of_the_planner():
    assert _offenders(("plan",), ("loomrl.planner", "loomrl.report", "loomrl.runtime", "loomrl.train")) == []


def test_the_planner_does_not_reach_into_the_runtime_or_the_trainer():
    assert _offenders(("planner",), ("loomrl.runtime", "loomrl.train", "loomrl.commands", "ray")) == []


PLANNER_ORDER = (
    "pipeline_fusion",
    "cost",
    "inputs",
    "simulation",
    "search",
    "calibration",
    "replanning",
    "describe",
    "planning",
)
"""The planner's rooms, each importing only those before it (and itself)."""


def test_the_planners_rooms_import_in_one_order():
    rank = {room: i for i, room in enumerate(PLANNER_ORDER)}
    assert {m.split(".")[2] for m in MODULES if m.startswith("loomrl.planner.")} == set(PLANNER_ORDER)
    bad = []
    for module, targets in sorted(_graph().items()):
        if not module.startswith("loomrl.planner."):
            continue
        mine = rank[module.split(".")[2]]
        for target in sorted(targets):
            if target.startswith("loomrl.planner.") and rank[target.split(".")[2]] > mine:
                bad.append(f"{module} imports {target}")
    assert bad == []


def test_the_runtime_and_the_role_do_not_reach_into_the_trainer():
    assert (
        _offenders(
            ("runtime", "role", "parallel", "checkpoint", "report"), ("loomrl.train", "loomrl.cli", "loomrl.commands")
        )
        == []
    )
    assert _offenders(("role", "parallel", "checkpoint"), ("loomrl.runtime",)) == []


def test_ops_run_models_only_through_their_passes():
    assert _offenders(("algorithms",), ("loomrl.parallel", "loomrl.role", "loomrl.runtime")) == []


def test_nothing_imports_a_private_name_of_another_module():
    bad = []
    for module in sorted(MODULES):
        for base, node in _import_nodes(module):
            if isinstance(node, ast.ImportFrom) and base.startswith("loomrl"):
                bad += [
                    f"{module} imports {base}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                ]
    assert bad == []


def test_no_two_public_classes_share_a_name():
    """One name per concept: a public class name means one thing in the whole package."""
    where: dict[str, list[str]] = defaultdict(list)
    for module, path in sorted(MODULES.items()):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(module)
    assert {name: modules for name, modules in where.items() if len(modules) > 1} == {}
