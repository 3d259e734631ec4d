"""A measurement in a fresh process, spec in and record out as JSON files: peak memory, load time and
caches mean nothing in a process that already loaded another variant."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent


def run_json_child(module: str, spec: dict) -> dict:
    """`python -m module SPEC_JSON OUT_JSON` in the repository root; the record it wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        subprocess.run([sys.executable, "-m", module, str(spec_path), str(out_path)], check=True, cwd=REPO_ROOT)
        return json.loads(out_path.read_text())


def json_child_main(measure: Callable[[dict], dict]) -> None:
    """The child's side: read the spec named by argv[1], write measure(spec) to argv[2]."""
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(measure(spec)))
