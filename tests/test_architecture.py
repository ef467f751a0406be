"""The package's walls, read from the source's imports (nothing is run).

- The engine has one public surface, `kvsieve.engine`: no module outside `engine/` (library, evaluations, server,
  command line, benchmarks) imports one of its modules.
- The registry of presets is looked up at the edges only (the command line, the server, the public `generate`,
  the report's pages): below them a method is a `MethodSpec`.
- The library's modules import each other without a circle (at import time; imports inside functions excluded).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src"
ENGINE = SOURCE / "kvsieve" / "engine"
ENGINE_MODULES = {path.stem for path in ENGINE.glob("*.py")} - {"__init__"}
# A profiler times the engine's private steps by patching them; it is the one reader of the engine's insides.
ENGINE_INSIDE_READERS = {ROOT / "benchmarks" / "ruler_profile.py"}
REGISTRY_EDGES = (
    "kvsieve/__init__.py",
    "kvsieve/registry.py",
    "kvsieve/cli/",
    "kvsieve/serve/",
    "kvsieve/engine/offline.py",
    "kvsieve/eval/report_",
)


def imports(path: Path, top_level_only: bool = False) -> list[str]:
    """The modules `path` imports: `from a.b import c` gives a.b and a.b.c (c may be a module)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            found += [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_files() -> list[Path]:
    return sorted((SOURCE / "kvsieve").rglob("*.py"))


def test_nothing_outside_the_engine_imports_its_modules():
    outside = [p for p in library_files() if ENGINE not in p.parents] + sorted((ROOT / "benchmarks").glob("*.py"))
    inside = {f"kvsieve.engine.{name}" for name in ENGINE_MODULES}
    leaks = {
        str(path.relative_to(ROOT)): sorted(set(imports(path)) & inside)
        for path in outside
        if path not in ENGINE_INSIDE_READERS
    }
    assert {path: found for path, found in leaks.items() if found} == {}
    assert ENGINE_INSIDE_READERS <= set(outside)  # the exception still names a file that exists


def test_the_registry_is_looked_up_at_the_edges_only():
    importers = [
        path.relative_to(SOURCE).as_posix()
        for path in library_files()
        if {"kvsieve.registry", "kvsieve.REGISTRY"} & set(imports(path))
        or "kvsieve.registry" in {name.rsplit(".", 1)[0] for name in imports(path)}
    ]
    assert "kvsieve/engine/offline.py" in importers  # the rule reads real imports
    assert [path for path in importers if not path.startswith(REGISTRY_EDGES)] == []


def test_the_library_has_no_import_circle():
    modules = {module_name(path): path for path in library_files()}

    def depends_on(path: Path) -> set[str]:  # `from a import b`: the module a.b where b is one, else a
        found = imports(path, top_level_only=True)
        return {dep for dep in found if dep in modules and not any(f.startswith(dep + ".") and f in modules
                                                                   for f in found)}  # fmt: skip

    graph = {name: depends_on(path) - {name} for name, path in modules.items()}
    assert "kvsieve.engine.pipeline" in graph["kvsieve.engine.request"]  # the graph holds real edges
    state: dict[str, str] = {}  # "open" while on the path, "done" after

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = "open"
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                return [*path, name, dep]
            if dep not in state and (circle := visit(dep, [*path, name])):
                return circle
        state[name] = "done"
        return None

    circles = [circle for name in sorted(graph) if name not in state and (circle := visit(name, []))]
    assert circles == []
