"""pyalloc's Python modules import one another in layers: no module imports, at its top or inside a
function, a module that imports it back (directly or through others). A circle means one of them
can only be used after the other has finished importing, which is how half-initialised-module
errors and needlessly lazy imports start."""
import ast
from pathlib import Path

import pyalloc

PACKAGE = Path(pyalloc.__file__).resolve().parent
SUBMODULES = {p.stem for p in PACKAGE.iterdir()
              if p.suffix in (".py", ".pyx") or p.name.endswith(".so")}
SUBMODULES = {name.split(".")[0] for name in SUBMODULES}


def imported_modules(path):
    """The pyalloc submodules that `path` imports anywhere in its text (module level or in functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "pyalloc":
                names = [f"pyalloc.{a.name}" if a.name in SUBMODULES else "pyalloc"
                         for a in node.names]
            else:
                names = [node.module]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "pyalloc":
                found.add(parts[1] if len(parts) > 1 else "__init__")
    return found


def import_graph():
    return {p.stem: imported_modules(p) - {p.stem} for p in PACKAGE.glob("*.py")}


def find_cycle(graph):
    """One import circle as a list of module names (first == last), or None."""
    state = {}                      # name -> 1 on the current path, 2 finished

    def visit(name, path):
        state[name] = 1
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep] if dep in path else path + [dep]
            if dep not in state:
                cycle = visit(dep, path + [dep])
                if cycle:
                    return cycle
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            cycle = visit(name, [name])
            if cycle:
                return cycle
    return None


def test_the_python_modules_import_each_other_without_a_circle():
    graph = import_graph()
    graph.pop("__init__", None)         # the package imports its modules; none imports it back
    assert "allocator" in graph and "pools" in graph and "defaults" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_circle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
