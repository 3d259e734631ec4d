"""bench/speculative.py runs end to end (its quick default-model workload) and writes its JSON."""
from __future__ import annotations

import json

from bench import speculative


def test_the_quick_benchmark_runs_and_checks_identity(tmp_path, capsys):
    path = tmp_path / "out.json"
    assert speculative.main(["--quick", "--only", "default", "--threads", "1", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    (result,) = report["results"]
    assert result["identical"] and result["draft_tokens"] > 0 and result["ratio"] > 0
    assert "(a) copy-heavy, models/default" in capsys.readouterr().out
