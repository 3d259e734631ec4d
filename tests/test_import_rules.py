"""The dependency rules of the design, read from the source so they cannot rot.

protos -> shared -> {gateway, worker}; the gateway never imports torch or worker; the
worker never imports gateway or grpc; request/block manager/scheduler are pure Python;
the model knows nothing of requests, schedulers or sockets.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STDLIB_OK = {"__future__"}

# package (or module path prefix) -> top-level imports it must never make
BANNED = {
    "protos": {"shared", "gateway", "worker", "torch"},
    # shared/ipc.py is where ZeroMQ is wrapped once; gRPC belongs to the gateway alone.
    "shared": {"gateway", "worker", "torch", "grpc", "numpy", "transformers"},
    # transformers imports torch whenever torch is installed, so it is banned here too.
    "gateway": {"worker", "torch", "transformers"},
    "worker": {"gateway", "grpc"},
    "worker/model": {"worker.engine", "worker.scheduler", "worker.block_manager", "worker.request",
                     "worker.model_runner", "zmq", "grpc", "transformers"},
}
PURE_PYTHON = ["worker/request.py", "worker/block_manager.py", "worker/scheduler.py"]
PURE_BANNED = {"torch", "numpy"}


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, as dotted names (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
    return names


def _violations(files, banned: set[str]) -> list[str]:
    found = []
    for path in files:
        for name in imports_of(path):
            for rule in banned:
                if name == rule or name.startswith(rule + "."):
                    found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


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


def test_the_checker_sees_a_violation(tmp_path):
    # Guard against a checker that silently finds nothing.
    bad = ROOT / "worker" / "request.py"
    assert "shared.sampling_params" in imports_of(bad)
    assert _violations([ROOT / "worker" / "engine.py"], {"torch"}) != []


@pytest.mark.parametrize("modules, banned", [
    ("gateway.server, gateway.client, gateway.__main__", "torch"),
    ("worker.service, worker.supervisor, worker.__main__", "grpc"),
])
def test_runtime_imports(modules, banned):
    """What a process really loads, transitive third-party imports included."""
    import subprocess
    import sys
    code = f"import sys; import {modules}; print({banned!r} in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", f"importing {modules} loads {banned}"
