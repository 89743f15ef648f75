"""The package's import graph: no circles, and dependencies point one way. Imports inside
functions count too: a lazy import is still a dependency.

    cli ─> generate / assemble / planning / ray ─> schedule ─> execute ─> io ─> builtin, models,
    compress, prefetch ─> util (with config and errors)
    klotski ─> planner, placement (never back; those two never use each other)
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("klotski", "planner", "placement")

# Each room of klotski/ and the rooms it may import (its own always allowed). A module of
# klotski/ not listed here (a new top-level module or room) fails test_every_module_has_a_room.
BOTTOM = {"util"}                       # klotski.util, klotski.config, klotski.errors
MAY_IMPORT = {
    "util": BOTTOM,
    "models": BOTTOM,
    "compress": BOTTOM | {"models"},
    "prefetch": BOTTOM | {"models"},
    "builtin": BOTTOM | {"models", "compress"},
    "io": BOTTOM | {"models", "compress", "prefetch", "builtin"},
    "execute": BOTTOM | {"io", "models", "compress", "prefetch", "builtin"},
    "schedule": BOTTOM | {"execute", "io", "models", "compress", "prefetch", "builtin"},
    "top": BOTTOM | {"schedule", "execute", "io", "models", "compress", "prefetch", "builtin", "top"},
    "bench": BOTTOM | {"top", "schedule", "execute", "io", "models", "compress", "prefetch", "builtin"},
    "serve": BOTTOM | {"top", "schedule", "execute", "io", "models", "compress", "prefetch", "builtin"},
    "cli": BOTTOM | {"top", "schedule", "execute", "io", "models", "compress", "prefetch", "builtin", "bench",
            "serve"},
}
TOP = {"klotski.assemble", "klotski.generate", "klotski.planning", "klotski.ray"}
MAX_TOP_LEVEL_MODULES = 8
MAX_LINES = 500


def room(module: str) -> str | None:
    """The room of a klotski module: its subpackage, `util` for config and errors, `top` for
    the composition root and the commands' entry points."""
    parts = module.split(".")
    if parts[0] != "klotski" or module == "klotski":
        return None
    if module in ("klotski.config", "klotski.errors"):
        return "util"
    if module in TOP:
        return "top"
    return parts[1] if len(parts) > 2 or (ROOT / "klotski" / parts[1]).is_dir() else "?"


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(modules: dict[str, Path], name: str, f: Path) -> list[tuple[str, str, int]]:
    """(imported module, imported name or '', line) for every import of our packages in `f`."""
    found = []
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name in modules]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                # `from pkg import mod` names a module; `from mod import thing` names mod
                sub = f"{node.module}.{a.name}"
                if sub in modules:
                    found.append((sub, "", node.lineno))
                elif node.module in modules:
                    found.append((node.module, a.name, node.lineno))
    return [(m, n, line) for m, n, line in found if m != name]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m, _, _ in _imports(modules, name, f)} for name, f in modules.items()}


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


def _wrong_way(graph) -> list[str]:
    bad = []
    for name, deps in graph.items():
        mine = room(name)
        if mine is None:
            continue
        for dep in deps:
            theirs = room(dep)
            if theirs is not None and theirs != mine and theirs not in MAY_IMPORT[mine]:
                bad.append(f"{name} ({mine}) imports {dep} ({theirs})")
    return sorted(bad)


def test_no_import_circles():
    graph = _graph()
    assert len(graph) > 50 and graph["klotski.assemble"]  # the walk really sees the package
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


def test_every_module_has_a_room():
    rooms = {name: room(name) for name in _graph() if name.startswith("klotski.")}
    assert not [n for n, r in rooms.items() if r not in MAY_IMPORT], rooms
    top = [f for f in (ROOT / "klotski").glob("*.py")]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, sorted(f.name for f in top)


def test_dependencies_between_rooms_point_one_way():
    assert _wrong_way(_graph()) == []


def test_the_room_check_finds_a_planted_wrong_way_import():
    graph = _graph()
    graph["klotski.models.spec"] = graph["klotski.models.spec"] | {"klotski.execute.pipeline"}
    graph["klotski.io.jobs"] = graph["klotski.io.jobs"] | {"klotski.schedule.sequences"}
    found = _wrong_way(graph)
    assert "klotski.models.spec (models) imports klotski.execute.pipeline (execute)" in found
    assert "klotski.io.jobs (io) imports klotski.schedule.sequences (schedule)" in found


def test_named_wrong_way_imports_stay_gone():
    """The ones the layout issue found, each its own check so a regression names itself."""
    graph = _graph()

    def reaches(a: str, b: str) -> bool:  # b among a's imports, directly
        return any(d == b or d.startswith(b + ".") for d in graph[a])

    assert not reaches("klotski.errors", "klotski.io")                 # errors never imports jobs
    assert not any(reaches(m, "klotski.builtin") for m in graph if m.startswith("klotski.models"))
    assert not any(reaches(m, "klotski.io") for m in graph if m.startswith("klotski.compress"))
    assert not reaches("klotski.planning", "klotski.execute.pipeline")  # not the pipeline's expert FFN
    assert not any(reaches(m, "klotski.cli") for m in graph if not m.startswith("klotski.cli"))


def test_no_module_imports_another_modules_private_names():
    """A name with a leading underscore is its module's own: another module that needs it
    needs it public (progress once read the output writer's private scanner)."""
    modules = _modules()
    private = [f"{name}:{line} imports {mod}.{what}" for name, f in modules.items()
               for mod, what, line in _imports(modules, name, f) if what.startswith("_")]
    assert private == []


def test_modules_stay_short():
    long = {str(f.relative_to(ROOT)): n for f in _modules().values()
            if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert long == {}
