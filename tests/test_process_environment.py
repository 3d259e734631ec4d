"""The environment a model process sets before torch loads (worker/process_environment.py): what
each worker setting becomes, that an operator's own value wins, and that with huge pages asked
for torch's large CPU tensors do land on 2 MiB pages where the host's THP allows it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import WorkerConfig
from worker.process_environment import (TORCH_CUDA_ALLOC_CONF, TORCH_HUGE_PAGES, anon_huge_page_bytes,
                                        apply_model_process_environment, model_process_environment)

REPO_ROOT = Path(__file__).resolve().parent.parent
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_each_setting_becomes_its_variable():
    assert WorkerConfig().cpu_huge_pages
    assert model_process_environment(True) == {TORCH_HUGE_PAGES: "1"}
    assert model_process_environment(False) == {}
    assert model_process_environment(False, "expandable_segments:True") == {
        TORCH_CUDA_ALLOC_CONF: "expandable_segments:True"}


def test_a_value_already_in_the_environment_wins():
    environ = {TORCH_HUGE_PAGES: "0"}
    assert apply_model_process_environment(True, "max_split_size_mb:512", environ) == {
        TORCH_HUGE_PAGES: "0", TORCH_CUDA_ALLOC_CONF: "max_split_size_mb:512"}
    assert environ == {TORCH_HUGE_PAGES: "0", TORCH_CUDA_ALLOC_CONF: "max_split_size_mb:512"}
    assert apply_model_process_environment(False, environ={}) == {}


def test_smaps_rollup_is_read_in_bytes(tmp_path):
    rollup = tmp_path / "smaps_rollup"
    rollup.write_text("Rss:              81920 kB\nAnonHugePages:     4096 kB\nSwap: 0 kB\n")
    assert anon_huge_page_bytes(str(rollup)) == 4096 * 1024
    assert anon_huge_page_bytes(str(tmp_path / "absent")) is None


_ALLOCATE = """
import json, sys
from worker.process_environment import anon_huge_page_bytes, apply_model_process_environment
apply_model_process_environment(sys.argv[1] == "on")
import torch
before = anon_huge_page_bytes()
weights = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)  # first touched after the allocation
print(json.dumps({"before": before, "after": anon_huge_page_bytes()}))
"""


def _huge_page_growth(setting: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != TORCH_HUGE_PAGES}
    out = subprocess.run([sys.executable, "-c", _ALLOCATE, setting], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    record = json.loads(out.stdout.strip().splitlines()[-1])
    return record["after"] - record["before"]


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
                    reason="this host has no transparent huge pages")
def test_with_huge_pages_a_large_tensor_lands_on_them():
    assert _huge_page_growth("on") >= 32 << 20  # most of the 64 MiB, in whole 2 MiB pages
    if "[madvise]" in THP_MODE.read_text():  # where THP is "always", every process gets them
        assert _huge_page_growth("off") < 4 << 20
