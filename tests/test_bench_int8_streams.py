"""bench.int8_streams compares what it says: one engine holding its INT8 weights as panels, one
keeping them row-major, on the same checkpoint, and reports whether their greedy tokens agree
(the two kernels sum in different orders, so a near-tie of a tiny random model may part them)."""
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
def test_int8_streams_runs_held_panels_against_row_major(llama_dir):
    result = subprocess.run([sys.executable, "-m", "bench.int8_streams", "--model", str(llama_dir), "--streams", "1,3",
                             "--rounds", "2", "--new-tokens", "6", "--threads", "1"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    header = re.search(r"held as panels: row-major (\d+) of (\d+), held panels (\d+) of (\d+)", result.stdout)
    assert header, result.stdout
    row_major, total, held, total_again = map(int, header.groups())
    assert total == total_again > 0 and row_major == 0 and held == total
    for streams in (1, 3):
        line = re.search(rf"{streams} streams: row-major +([\d.]+) tok/s, held panels +([\d.]+) tok/s, ([\d.]+)x "
                         rf"\(greedy identical (\d+)/{streams}\)", result.stdout)
        assert line, result.stdout
        row_major, held, ratio, identical = (float(v) for v in line.groups())
        assert row_major > 0 and held > 0 and abs(ratio - held / row_major) < 0.01
        assert identical >= streams - 1
