"""The cluster's core plan (shared/cpu_affinity.py): each worker its own cores, the gateway the
reserved ones, and nothing pinned where the host lacks the cores."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shared.config import load_config
from shared.cpu_affinity import GATEWAY, pin_process, plan_cores


@pytest.fixture
def cores(monkeypatch):
    def use(n: int) -> list[int]:
        monkeypatch.setattr("shared.config.usable_cores", lambda: list(range(n)))
        return list(range(n))
    return use


def test_each_worker_gets_its_own_cores_and_the_gateway_the_rest(cores):
    plan = plan_cores(load_config(None, {"num_workers": 2}), cores(8))  # 3 threads each
    assert plan == {"worker-0": [0, 1, 2], "worker-1": [3, 4, 5], GATEWAY: [7]}
    plan = plan_cores(load_config(None, {"num_workers": 1, "worker.reserved_cores": 1}), cores(2))
    assert plan == {"worker-0": [0], GATEWAY: [1]}


def test_nothing_is_pinned_without_the_cores_or_when_switched_off(cores):
    assert plan_cores(load_config(None, {"num_workers": 2}), cores(2)) is None  # no core reserved below 8
    assert plan_cores(load_config(None, {"num_workers": 1}), cores(2)) is None
    assert plan_cores(load_config(None, {"num_workers": 2, "worker.reserved_cores": 1}), cores(2)) is None  # 1 + 2 > 2
    assert plan_cores(load_config(None, {"num_workers": 1, "worker.reserved_cores": 0}), cores(2)) is None
    assert plan_cores(load_config(None, {"num_workers": 1, "worker.pin_cores": False}), cores(8)) is None
    assert plan_cores(load_config(None, {"num_workers": 2, "worker.num_threads": 4}), cores(8)) is None


def test_a_pinned_process_runs_on_its_cores_only(tmp_path):
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs affinity masks and 2 cores")
    # In a child process, so this one keeps its mask.
    code = ("import os, sys; from shared.config import load_config; from shared.cpu_affinity import pin_process;"
            "c = load_config(None, {'num_workers': 1, 'worker.reserved_cores': 1});"
            "print(pin_process(sys.argv[1], c), sorted(os.sched_getaffinity(0)))")
    usable = sorted(os.sched_getaffinity(0))
    for name, want in (("worker-0", usable[:len(usable) - 1]), (GATEWAY, usable[-1:])):
        out = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, timeout=60,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), check=True).stdout
        assert out.split(" ", 1)[1].strip() == str(want) and out.startswith(str(want))
    assert pin_process("worker-7", load_config(None, {"num_workers": 1, "worker.reserved_cores": 1})) is None  # not in the plan: untouched
    assert sorted(os.sched_getaffinity(0)) == usable
