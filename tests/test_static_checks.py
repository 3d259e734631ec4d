"""pyflakes over the project's own source: no undefined or shadowed names, no unused imports or
variables. An undefined name in a rarely taken branch (an error path, a fallback) fails only when
that branch runs, so it is caught here rather than by a client."""
from __future__ import annotations

from pathlib import Path

from pyflakes import api, reporter

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("protos", "shared", "gateway", "worker", "bench", "tools", "deploy", "tests")


class _Collect(reporter.Reporter):
    def __init__(self):
        self.found: list[str] = []

    def unexpectedError(self, filename, message):
        self.found.append(f"{filename}: {message}")

    def syntaxError(self, filename, message, lineno, offset, text):
        self.found.append(f"{filename}:{lineno}: {message}")

    def flake(self, message):
        self.found.append(str(message))


def _sources() -> list[Path]:
    # protoc writes the *_pb2*.py modules; a test elsewhere checks they are current.
    return sorted(p for package in CHECKED for p in (ROOT / package).rglob("*.py")
                  if "_pb2" not in p.name and ".cache" not in p.parts)


def test_pyflakes_finds_nothing():
    collect = _Collect()
    for path in _sources():
        api.checkPath(str(path), collect)
    assert not collect.found, "\n".join(collect.found)


def test_the_check_sees_an_undefined_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    try:\n        pass\n    except ValueError:\n        return error_body()\n")
    collect = _Collect()
    api.checkPath(str(bad), collect)
    assert any("undefined name 'error_body'" in line for line in collect.found)
