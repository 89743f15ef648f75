"""The package's import graph: no circles, and dependencies point one way (klotski uses
planner and placement; those two never use klotski nor each other). Imports inside
functions count too: a lazy import is still a dependency."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("klotski", "planner", "placement")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, f in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # `from pkg import mod` names a module; `from mod import thing` names mod
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def _cycle(graph) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circles():
    graph = _graph()
    assert len(graph) > 30 and graph["klotski.assemble"]  # the walk really sees the package
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_a_planted_circle():
    graph = _graph()
    graph["planner.units"] = graph["planner.units"] | {"klotski.config"}  # config imports units
    assert _cycle(graph) is not None


def test_dependencies_point_from_klotski_to_planner_and_placement():
    for name, deps in _graph().items():
        pkg = name.split(".")[0]
        others = {d.split(".")[0] for d in deps} - {pkg}
        if pkg != "klotski":
            assert not others, f"{name} imports {sorted(others)}"
