"""The apps of `platform/flywheel/` import each other in one direction only: no import circle spans two apps.

Read from the source with `ast`, every `import` counts, at module level and inside functions alike: a local
import only delays a circle to run time, it does not remove it. The layers, lowest first (ARCHITECTURE.md's
Layout table says the same in its "may import" column):

    accounts < trajectories < failures (with failures.clustering) < registry < evals < environments < training

An app imports its own layer and the layers below it. Why this order: failures group trajectories; the
registry's versions are what eval runs measure (an eval run's model version is a registry row); task sets
are built on the eval suites' row shape and machinery (`evals.models.ItemBase`); training uses all of them.
Where a lower app needs to reach a higher one, the higher one registers itself on the lower one's hook
(`accounts.signals.project_created`, `evals.kinds`), or the lower one follows the reverse relation the higher
one's foreign key declares (`Trajectory.failure_assignments`), as Django's string references let models do.

Platform-level modules are no app. What reads or fills every app sits above them all (`flywheel/seed/`, the
demo seeding; `flywheel/dashboard/`); shared parts sit low (`flywheel/api/auth.py`, `outbox.py`,
`demo_status.py`, …). Each such module is its own node, so a circle that runs through one still counts (an
app → `flywheel.x` → a higher app → the first app is a circle). The one exception is the API's wiring:
`flywheel/api/__init__.py` imports every app's router so the URLconf loads them, the way `urls.py` includes
them by name."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "platform"
LAYERS = ["accounts", "trajectories", "failures", "registry", "evals", "environments", "training"]
# Modules whose imports of the apps are wiring, not use: they load every app's routes.
WIRING = {"flywheel.api"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / "flywheel").rglob("*.py")) if "migrations" not in p.parts}


def unit_of(module: str) -> str:
    """The node a module counts as: its app, or the module itself when it belongs to no app."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return module


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(flywheel module imported, line) for every import in the file, however deep in a function."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                # `from flywheel.x import y` imports the module flywheel.x.y when there is one, else flywheel.x.
                found.append((f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base, node.lineno))
    return [(name, line) for name, line in found if name == "flywheel" or name.startswith("flywheel.")]


def unit_graph() -> dict[str, dict[str, str]]:
    """unit -> {imported unit: where (the first `file:line imports module` seen)}."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, dict[str, str]] = defaultdict(dict)
    for module, path in modules.items():
        source = unit_of(module)
        graph[source]  # every unit is a node, even one that imports nothing
        for name, line in imports_of(module, path, known):
            target = unit_of(name)
            if target == source or name == "flywheel" or (module in WIRING and target in LAYERS):
                continue
            graph[source].setdefault(target, f"{path.relative_to(ROOT.parent)}:{line} imports {name}")
    return graph


def strongly_connected(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Tarjan's components of more than one node: each holds at least one circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def circle_through(graph: dict[str, dict[str, str]], component: list[str], start: str) -> list[str]:
    """One shortest circle from the app `start` back to it through at least one other app, inside the component
    (breadth first over (node, another app seen yet))."""
    inside = set(component)
    came: dict[tuple[str, bool], tuple[str, bool]] = {}
    queue = [(start, False)]
    while queue:
        state = queue.pop(0)
        for nxt in sorted(graph[state[0]]):
            if nxt not in inside:
                continue
            if nxt == start:
                if not state[1]:
                    continue
                path = [state]
                while path[-1] != (start, False):
                    path.append(came[path[-1]])
                return [start, *(node for node, _ in reversed(path[:-1])), start]
            seen = state[1] or nxt in LAYERS
            if (nxt, seen) not in came:
                came[(nxt, seen)] = state
                queue.append((nxt, seen))
    return []


def app_circles(graph: dict[str, dict[str, str]]) -> list[str]:
    """Every circle that spans two apps, one per pair of apps, each edge with the import that makes it."""
    lines = []
    for component in strongly_connected(graph):
        apps = [u for u in component if u in LAYERS]
        if len(apps) < 2:
            continue
        for a in apps:
            circle = circle_through(graph, component, a)
            steps = [f"    {x} -> {y}: {graph[x][y]}" for x, y in zip(circle, circle[1:], strict=False)]
            lines.append(" -> ".join(circle) + "\n" + "\n".join(steps))
    return lines


def test_the_reader_sees_local_imports_and_relative_ones(tmp_path):
    # The test's own parser, on a file written for it: a function-local import is an edge like any other.
    path = tmp_path / "mod.py"
    path.write_text("import flywheel.accounts.models\n"
                    "def f():\n    from flywheel.registry import gate\n    from .x import y\n")
    found = imports_of("flywheel.evals.mod", path, known={"flywheel.registry.gate"})
    assert ("flywheel.accounts.models", 1) in found
    assert ("flywheel.registry.gate", 3) in found
    assert ("flywheel.evals.x", 4) in found


def test_a_circle_through_a_platform_module_is_found():
    graph = {"accounts": {"flywheel.x": "a"}, "flywheel.x": {"training": "b", "accounts": "d"},
             "training": {"accounts": "c"}}
    circles = app_circles(graph)
    # The circle through one app alone (accounts -> flywheel.x -> accounts) is no offence; the other one is.
    assert circles and circles[0].startswith("accounts -> flywheel.x -> training -> accounts")


def test_no_import_circle_spans_two_apps():
    circles = app_circles(unit_graph())
    print("\n\n".join(circles))
    assert not circles, "import circles between apps:\n" + "\n\n".join(circles)


def test_apps_import_only_their_own_layer_and_those_below():
    rank = {app: i for i, app in enumerate(LAYERS)}
    upward = [f"{a} -> {b}: {where}" for a, edges in unit_graph().items() if a in rank
              for b, where in edges.items() if b in rank and rank[b] > rank[a]]
    print("\n".join(upward))
    assert not upward, "an app imports a higher layer:\n" + "\n".join(upward)
