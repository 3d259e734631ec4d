"""The dependency rules of the design, read from the source so they cannot rot.

protos -> shared -> {gateway, worker}; the gateway never imports torch or worker; the
worker never imports gateway or grpc; nothing of the core imports the deploy launchers or Ray;
request/block manager/scheduler are pure Python;
the model knows nothing of requests, schedulers or sockets; and no module of the project
imports itself back through others, not even under `if TYPE_CHECKING:` or inside a function.
Every layering check of the test suite lives here, on the one import reader below.
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protos", "shared", "gateway", "worker", "bench", "tools", "deploy")

# package (or module path prefix) -> top-level imports it must never make
BANNED = {
    "protos": {"shared", "gateway", "worker", "torch", "deploy", "ray"},
    # shared/ipc.py is where ZeroMQ is wrapped once; gRPC belongs to the gateway alone.
    "shared": {"gateway", "worker", "torch", "grpc", "numpy", "transformers", "deploy", "ray"},
    # transformers imports torch whenever torch is installed, so it is banned here too.
    "gateway": {"worker", "torch", "transformers", "deploy", "ray"},
    "worker": {"gateway", "grpc", "deploy", "ray"},
    # The launchers drive the processes from outside: never their internals.
    "deploy": {"gateway", "worker", "torch"},
    "worker/model": {"worker.engine", "worker.scheduler", "worker.scheduled_step", "worker.block_manager",
                     "worker.request", "worker.model_runner", "zmq", "grpc", "transformers"},
}
PURE_PYTHON = ["worker/request.py", "worker/block_manager.py", "worker/scheduler.py", "worker/scheduled_step.py",
               "worker/outputs.py", "shared/engine_config.py"]
PURE_BANNED = {"torch", "numpy"}
# Modules whose own imports are the standard library only (no project module either).
STDLIB_ONLY = ["worker/block_manager.py", "shared/quantization_rule.py", "shared/supervisor.py", "shared/block_hash.py",
               "deploy/ray/process.py"]


# ---- reading imports --------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportStatement:
    """One import statement of a file: the dotted modules it names, and where it sits."""

    module: str  # `import a.b` -> "a.b"; `from a.b import c` -> "a.b" (relative imports resolved)
    names: tuple[str, ...]  # the names of a `from` import; () for a plain `import`
    line: int
    context: str  # "", "under TYPE_CHECKING" or "inside a function"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def import_statements(path: Path, root: Path = ROOT) -> list[ImportStatement]:
    """Every import statement of a file, wherever it is: module level, under
    `if TYPE_CHECKING:`, inside functions and classes, in try/except blocks."""
    tree = ast.parse(path.read_text(), filename=str(path))
    # The package a relative import counts from: the module's own for an __init__.py.
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found: list[ImportStatement] = []

    def visit(node: ast.AST, context: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = context
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = context or "inside a function"
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append(ImportStatement(alias.name, (), child.lineno, context))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = package.split(".") if package else []
                    base = parts[: len(parts) - child.level + 1]
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module or ""
                names = tuple(alias.name for alias in child.names)
                found.append(ImportStatement(module, names, child.lineno, context))
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_one(stmt, context or "under TYPE_CHECKING")
                for stmt in child.orelse:
                    visit_one(stmt, context)
                continue
            visit(child, inner)

    def visit_one(stmt: ast.stmt, context: str) -> None:
        holder = ast.Module(body=[stmt], type_ignores=[])
        visit(holder, context)

    visit(tree, "")
    return found


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, as dotted names (relative imports resolved). A `from M
    import n` gives both M and M.n, so importing a submodule by name is seen as importing it."""
    names: set[str] = set()
    for statement in import_statements(path):
        names.add(statement.module)
        names.update(f"{statement.module}.{name}" for name in statement.names if name != "*")
    return names


def _violations(files, banned: set[str]) -> list[str]:
    found = []
    for path in files:
        for name in sorted(imports_of(path)):
            for rule in banned:
                if name == rule or name.startswith(rule + "."):
                    found.append(f"{path.relative_to(ROOT)} imports {name}")
    return sorted(set(found))


def _local_closure(path: Path) -> list[Path]:
    """The file and every project module it imports, transitively."""
    seen, todo = set(), [path]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for name in imports_of(current):
            candidate = ROOT / Path(*name.split("."))
            for target in (candidate.with_suffix(".py"), candidate / "__init__.py"):
                if target.is_file():
                    todo.append(target)
    return sorted(seen)


# ---- the module graph and its cycles ---------------------------------------------------------


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    where: str  # "worker/calibrate.py:25 (under TYPE_CHECKING)"


def module_graph(root: Path = ROOT, packages=PACKAGES) -> dict[str, dict[str, Edge]]:
    """module -> {imported project module -> the first statement that imports it}.

    `from a.b import c` is an edge to the module a.b.c when c is one, else to a.b. The parent
    packages that Python initialises on the way are not edges: every package `__init__.py` of
    the project that imports anything is a module of its own here and shows its own edges."""
    files = {module_name(path, root): path
             for package in packages for path in sorted((root / package).rglob("*.py"))}
    graph: dict[str, dict[str, Edge]] = {name: {} for name in files}
    for source, path in files.items():
        for statement in import_statements(path, root):
            targets = []
            if statement.names:
                submodules = [f"{statement.module}.{name}" for name in statement.names
                              if f"{statement.module}.{name}" in files]
                targets += submodules
                if len(submodules) < len(statement.names) and statement.module in files:
                    targets.append(statement.module)
            else:
                # `import a.b.c` runs a.b.c; a name that is not a module resolves to its package.
                parts = statement.module.split(".")
                while parts and ".".join(parts) not in files:
                    parts.pop()
                if parts:
                    targets.append(".".join(parts))
            for target in targets:
                if target != source and target not in graph[source]:
                    context = f" ({statement.context})" if statement.context else ""
                    where = f"{path.relative_to(root)}:{statement.line}{context}"
                    graph[source][target] = Edge(source, target, where)
    return graph


def strongly_connected(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """The knots of the graph (Tarjan): each a sorted list of 2+ modules that all reach each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    knots: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            knot = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                knot.append(member)
                if member == node:
                    break
            if len(knot) > 1:
                knots.append(sorted(knot))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for node in sorted(graph):
            if node not in index:
                connect(node)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(knots)


def shortest_cycle(graph: dict[str, dict[str, Edge]], knot: list[str]) -> list[Edge]:
    """A shortest import cycle through the knot's first module, as the edges that make it."""
    start, members = knot[0], set(knot)
    came_from: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target, edge in sorted(graph[node].items()):
                if target not in members:
                    continue
                if target == start:
                    cycle = [edge]
                    while cycle[0].source != start:
                        cycle.insert(0, came_from[cycle[0].source])
                    return cycle
                if target not in came_from:
                    came_from[target] = edge
                    following.append(target)
        frontier = following
    raise AssertionError(f"{knot} is not a cycle")


def describe_cycles(graph: dict[str, dict[str, Edge]]) -> list[str]:
    """One line per knot: the cycle by module names, then the statement behind each edge."""
    lines = []
    for knot in strongly_connected(graph):
        cycle = shortest_cycle(graph, knot)
        path = " -> ".join([edge.source for edge in cycle] + [cycle[0].source])
        line = f"import cycle {path}: " + "; ".join(edge.where for edge in cycle)
        others = sorted(set(knot) - {edge.source for edge in cycle})
        if others:
            line += f" (the same knot also holds {', '.join(others)})"
        lines.append(line)
    return lines


# ---- the rules --------------------------------------------------------------------------------


@pytest.mark.parametrize("area", sorted(BANNED))
def test_layering(area):
    files = sorted((ROOT / area).rglob("*.py"))
    assert files, f"no python files under {area}"
    assert _violations(files, BANNED[area]) == []


@pytest.mark.parametrize("module", PURE_PYTHON)
def test_pure_python_modules_import_no_torch(module):
    path = ROOT / module
    closure = _local_closure(path)
    assert _violations(closure, PURE_BANNED) == []


@pytest.mark.parametrize("module", STDLIB_ONLY)
def test_module_imports_only_stdlib(module):
    """Imports the standard library only, or another module held to the same rule."""
    stdlib_only = {m.removesuffix(".py").replace("/", ".") for m in STDLIB_ONLY}
    roots = {statement.module.split(".")[0] for statement in import_statements(ROOT / module)
             if statement.module not in stdlib_only}
    assert roots <= set(sys.stdlib_module_names) | {"__future__"}, roots


def test_no_import_cycle():
    """No cycle anywhere in the project's packages: one hidden under `if TYPE_CHECKING:` still
    counts (it is a seam that only works in one order), and so does a function-local import."""
    graph = module_graph()
    assert len(graph) > 50, f"only {len(graph)} modules found under {PACKAGES}"
    cycles = describe_cycles(graph)
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("modules, banned", [
    ("gateway.server, gateway.client, gateway.__main__", ("torch",)),
    ("worker.service, worker.supervisor, worker.__main__", ("grpc",)),
    # The gateway imports this module; it must not pull in heavy numeric libraries.
    ("shared.sampling_params", ("torch", "numpy")),
])
def test_runtime_imports(modules, banned):
    """What a process really loads, transitive third-party imports included."""
    import subprocess
    code = f"import sys; import {modules}; print([m for m in {banned!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"importing {modules} loads {result.stdout.strip()}"


# ---- the checkers themselves ------------------------------------------------------------------


def test_the_checker_sees_a_violation(tmp_path):
    # Guard against a checker that silently finds nothing.
    bad = ROOT / "worker" / "request.py"
    assert "shared.sampling_params" in imports_of(bad)
    assert _violations([ROOT / "worker" / "engine.py"], {"torch"}) != []


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_cycle_checker_sees_hidden_cycles(tmp_path):
    _write_tree(tmp_path, {
        "pkg/__init__.py": "",
        # a cycle through a TYPE_CHECKING block
        "pkg/engine.py": "from typing import TYPE_CHECKING\nimport pkg.calibrate\n",
        "pkg/calibrate.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.engine import Engine\n",
        # a cycle through a function-local, relative `from . import module`
        "pkg/a.py": "from pkg.b import thing\n",
        "pkg/b.py": "thing = 1\ndef later():\n    from . import a\n    return a\n",
        # no cycle: a chain, a self-reference and an import of the package's own __init__
        "pkg/c.py": "import pkg.d\nimport pkg\n",
        "pkg/d.py": "import os\nfrom pkg import d\n",
        "pkg/sub/__init__.py": "from .e import E\n",
        "pkg/sub/e.py": "E = 1\nimport pkg.c\n",
    })
    graph = module_graph(tmp_path, ("pkg",))
    assert strongly_connected(graph) == [["pkg.a", "pkg.b"], ["pkg.calibrate", "pkg.engine"]]
    cycles = describe_cycles(graph)
    assert cycles[0] == "import cycle pkg.a -> pkg.b -> pkg.a: pkg/a.py:1; pkg/b.py:3 (inside a function)"
    assert cycles[1] == ("import cycle pkg.calibrate -> pkg.engine -> pkg.calibrate: "
                         "pkg/calibrate.py:3 (under TYPE_CHECKING); pkg/engine.py:2")


def test_the_cycle_checker_names_a_longer_cycle_and_its_knot(tmp_path):
    _write_tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/x.py": "from pkg import y\n",
        "pkg/y.py": "import pkg.z\n",
        "pkg/z.py": "import pkg.x\nimport pkg.w\n",
        "pkg/w.py": "class W:\n    def f(self):\n        import pkg.z\n",
    })
    assert describe_cycles(module_graph(tmp_path, ("pkg",))) == [
        "import cycle pkg.w -> pkg.z -> pkg.w: pkg/w.py:3 (inside a function); pkg/z.py:2"
        " (the same knot also holds pkg.x, pkg.y)"]
