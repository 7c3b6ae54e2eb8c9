"""The package's modules import one another without a circle: each module's imports, at the top
or inside a function, taken from its source. A package's own __init__ re-exporting its modules
(cubeserve.engine's lazy names) is not a circle."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cubeserve"


def _graph() -> dict[str, set[str]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
        graph[name] = {m for m in imported if m in modules and m != name and not m.startswith(name + ".")}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_of_the_package_imports_itself_through_others():
    graph = _graph()
    assert "cubeserve.serving.repository" in graph and graph["cubeserve.server.local_triton"]
    assert _circles(graph) == [], "modules importing one another in a circle: move what both need into one of them"


def test_a_circle_is_found():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_nothing_inside_tritons_stubs_imports_the_processes_around_it():
    """cubeserve/serving/ runs in Triton's python stubs; cubeserve/server/ is the supervisor, the
    front ends and the local server around tritonserver (docs/architecture.md)."""
    graph = _graph()
    crossing = {(m, t) for m, targets in graph.items() if m.startswith("cubeserve.serving")
                for t in targets if t.startswith("cubeserve.server")}
    assert crossing == set()
