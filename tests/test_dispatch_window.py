"""The dispatcher's pacing (gateway/dispatch_window.py): a request after a quiet window leaves at
once, a burst's later requests wait out the window together, and empty passes do not count."""
from __future__ import annotations

import pytest

from gateway.dispatch_window import DispatchWindow


def test_a_pass_after_a_quiet_window_runs_at_once():
    window = DispatchWindow(0.002)
    assert window.wait_s(100.0) == 0.0  # nothing ran yet
    window.passed(100.0, had_work=True)
    assert window.wait_s(100.0025) == 0.0  # a whole window later


def test_a_wake_up_within_the_window_waits_out_its_rest():
    window = DispatchWindow(0.002)
    window.passed(100.0, had_work=True)
    assert window.wait_s(100.0005) == pytest.approx(0.0015)
    assert window.wait_s(100.0019) == pytest.approx(0.0001)


def test_a_pass_over_an_empty_queue_does_not_start_a_window():
    window = DispatchWindow(0.002)
    window.passed(100.0, had_work=True)
    window.passed(100.003, had_work=False)  # a heartbeat's wake-up found nothing queued
    assert window.wait_s(100.0031) == 0.0


def test_no_window_never_waits():
    window = DispatchWindow(0.0)
    window.passed(100.0, had_work=True)
    assert window.wait_s(100.0) == 0.0
