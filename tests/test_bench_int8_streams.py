"""bench.int8_streams compares what it says: one engine holding its INT8 weights as panels (in the
kernels' groups), one keeping them row-major or holding plain panels, on the same checkpoint, and
reports whether their greedy tokens agree (row-major sums in another order, so a near-tie of a tiny
random model may part them; plain and grouped panels sum alike)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from worker.model import cpu_kernels

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.skipif(cpu_kernels.load() is None, reason="our CPU kernels did not build")
@pytest.mark.parametrize("baseline", ["row-major", "plain panels"])
def test_int8_streams_runs_held_panels_against_its_baseline(llama_dir, baseline):
    result = subprocess.run([sys.executable, "-m", "bench.int8_streams", "--model", str(llama_dir), "--streams", "1,3",
                             "--rounds", "2", "--new-tokens", "6", "--threads", "1",
                             "--baseline", baseline.replace(" ", "-")],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    header = re.search(rf"held as panels: {baseline} (\d+) of (\d+), held panels (\d+) of (\d+); "
                       rf"panels per group: {baseline} \[(\d*)\], held panels \[(\d+)\]", result.stdout)
    assert header, result.stdout
    other, total, held, total_again, other_group, held_group = header.groups()
    assert int(total) == int(total_again) > 0 and int(held) == int(total)
    assert held_group == str(cpu_kernels.load().int8_weight_panel_group())
    if baseline == "row-major":
        assert int(other) == 0 and other_group == ""
    else:
        assert int(other) == int(total) and other_group == "1"
    for streams in (1, 3):
        line = re.search(rf"{streams} streams: {baseline} +([\d.]+) tok/s, held panels +([\d.]+) tok/s, ([\d.]+)x "
                         rf"\(greedy identical (\d+)/{streams}\)", result.stdout)
        assert line, result.stdout
        other_rate, held_rate, ratio, identical = (float(v) for v in line.groups())
        assert other_rate > 0 and held_rate > 0 and abs(ratio - held_rate / other_rate) < 0.01
        assert identical >= streams - (1 if baseline == "row-major" else 0)  # plain panels sum in the same order
