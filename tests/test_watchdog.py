"""The memory watchdog and worker health, in pieces: levels and hysteresis from injected
readings, KV-aware accounting, the CPU reader, the scheduler's admission pause and
lowest-priority preemption, readiness of a hung loop on a fake clock, and SIGUSR1 stack dumps
from a real worker process."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch

from cluster_harness import ROOT, free_port, write_config
from shared.config import ConfigError, load_config
from shared.sampling_params import SamplingParams
from worker.block_manager import BlockManager
from worker.memory import KVUsage, MemoryReader, MemoryReading
from worker.request import Request, RequestStatus
from worker.scheduler import Scheduler, SchedulerConfig
from worker.transport import LoadSnapshot, LoopProgress, StaticInfo, build_heartbeat
from worker.watchdog import MemoryLevel, Watchdog

LIMIT = 1000
OK, HIGH, CRITICAL = MemoryLevel.OK, MemoryLevel.HIGH, MemoryLevel.CRITICAL


class FakeMemory:
    """A reader whose used bytes the test sets; records whether each read was a detailed one."""

    def __init__(self, used: int = 0, total: int = LIMIT):
        self.used, self.total, self.reads = used, total, []

    def __call__(self, detailed: bool = False) -> MemoryReading:
        self.reads.append(detailed)
        return MemoryReading(used_bytes=self.used, total_bytes=self.total)


def levels(watchdog: Watchdog, memory: FakeMemory, fractions) -> list[MemoryLevel]:
    out = []
    for fraction in fractions:
        memory.used = int(fraction * LIMIT)
        out.append(watchdog.update().level)
    return out


def test_levels_enter_at_their_fraction_and_leave_only_below_it_minus_hysteresis():
    memory = FakeMemory()
    watchdog = Watchdog(memory, limit_bytes=LIMIT, high_fraction=0.85, critical_fraction=0.95,
                        hysteresis_fraction=0.05)
    assert levels(watchdog, memory, [0.5, 0.849, 0.85, 0.81, 0.80, 0.799, 0.5]) == [
        OK, OK, HIGH, HIGH, HIGH, OK, OK]
    assert levels(watchdog, memory, [0.96, 0.91, 0.90, 0.899, 0.81, 0.79]) == [
        CRITICAL, CRITICAL, CRITICAL, HIGH, HIGH, OK]
    assert levels(watchdog, memory, [0.86, 0.96, 0.94, 0.99, 0.5]) == [HIGH, CRITICAL, CRITICAL, CRITICAL, OK]


def test_a_reading_hovering_at_a_threshold_does_not_flap():
    memory = FakeMemory()
    watchdog = Watchdog(memory, limit_bytes=LIMIT)
    seen = levels(watchdog, memory, [0.84, 0.86, 0.84, 0.86, 0.83, 0.86, 0.82] * 3)
    changes = sum(a != b for a, b in zip(seen, seen[1:]))
    assert seen[0] == OK and changes == 1 and seen[-1] == HIGH
    # Without hysteresis the same readings flap on every sample.
    memory2 = FakeMemory()
    flappy = Watchdog(memory2, limit_bytes=LIMIT, hysteresis_fraction=0.0)
    seen = levels(flappy, memory2, [0.84, 0.86, 0.84, 0.86])
    assert seen == [OK, HIGH, OK, HIGH]


def test_limit_defaults_to_the_readings_total_and_bad_fractions_are_refused():
    watchdog = Watchdog(FakeMemory(used=900, total=1000))
    assert watchdog.update().limit_bytes == 1000 and watchdog.status.level == HIGH
    with pytest.raises(ValueError, match="hysteresis_fraction"):
        Watchdog(FakeMemory(), high_fraction=0.9, critical_fraction=0.8)
    with pytest.raises(ConfigError, match="memory_high_fraction"):
        load_config(None, {"worker.memory_high_fraction": 0.97})
    with pytest.raises(ConfigError, match="memory_hysteresis_fraction"):
        load_config(None, {"worker.memory_hysteresis_fraction": 0.9})
    with pytest.raises(ConfigError, match="hung_after_s"):
        load_config(None, {"worker.hung_after_s": 0})


def test_committed_memory_counts_only_the_kv_blocks_that_hold_data():
    # 100 blocks of 10 bytes: the pool is 1000 of the 1500 resident bytes.
    memory = FakeMemory(used=1500, total=10_000)
    watchdog = Watchdog(memory, limit_bytes=1000)
    status = watchdog.update(KVUsage(num_blocks=100, num_used_blocks=20, num_cached_blocks=30, bytes_per_block=10))
    assert status.used_bytes == 500 + 500 and status.level == CRITICAL
    # To leave CRITICAL the committed bytes must drop below (0.95 - 0.05) * 1000 = 900: 101 bytes, 11 blocks.
    assert watchdog.excess_blocks(CRITICAL) == 11 and watchdog.excess_blocks(HIGH) == 21
    status = watchdog.update_kv(KVUsage(num_blocks=100, num_used_blocks=20, num_cached_blocks=19,
                                        bytes_per_block=10))
    assert status.used_bytes == 890 and status.level == HIGH and watchdog.excess_blocks(CRITICAL) == 0
    assert memory.reads == [False, False]  # update_kv judged again without reading


def test_the_timer_reads_in_detail_and_stops():
    memory = FakeMemory(used=100)
    watchdog = Watchdog(memory, limit_bytes=LIMIT, poll_interval_s=0.01)
    watchdog.start()
    deadline = time.monotonic() + 5
    while memory.reads.count(True) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    watchdog.stop()
    count = len(memory.reads)
    time.sleep(0.05)
    assert len(memory.reads) == count


def test_cpu_reader_reports_the_resident_set():
    reader = MemoryReader(torch.device("cpu"))
    reading = reader.read(detailed=True)
    assert reading.used_bytes == reading.resident_bytes > 0 and reading.total_bytes > 0
    assert reading.fragmentation_bytes == 0 and reading.utilization_percent >= 0
    assert "resident set (rss)" in reader.report()


# ---- the scheduler acts ----------------------------------------------------------------------
def _scheduler(num_blocks=64) -> Scheduler:
    return Scheduler(SchedulerConfig(admission_watermark=0.0), BlockManager(num_blocks, 4))


def _req(request_id: str, priority: int = 0) -> Request:
    # A prompt of its own: identical prompts would wait on each other to share their blocks.
    first = sum(map(ord, request_id)) % 50 + 1
    return Request(request_id, [first, 2, 3, 4, 5], SamplingParams(max_tokens=8), priority=priority)


def test_paused_admission_keeps_waiting_requests_waiting_but_lets_one_in_when_nothing_runs():
    s = _scheduler()
    s.admission_paused = True
    for i in range(3):
        s.add(_req(f"r{i}"))
    assert [x.request.request_id for x in s.schedule().scheduled] == ["r0"]  # progress: one, not three
    assert [r.request_id for r in s.waiting] == ["r1", "r2"]
    assert [x.request.request_id for x in s.schedule().scheduled] == ["r0"]
    s.admission_paused = False
    assert {x.request.request_id for x in s.schedule().scheduled} == {"r0", "r1", "r2"}
    s.blocks.check_integrity()


def test_preempt_lowest_takes_the_lowest_priority_then_newest_and_never_the_last():
    s = _scheduler()
    for request_id, priority in [("urgent", -1), ("a", 0), ("b", 0), ("batch", 5)]:
        s.add(_req(request_id, priority))
    s.schedule()
    order = [s.preempt_lowest().request_id for _ in range(3)]
    assert order == ["batch", "b", "a"]
    assert s.preempt_lowest() is None and [r.request_id for r in s.running] == ["urgent"]
    assert [r.request_id for r in s.waiting] == ["a", "b", "batch"]
    assert all(r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0 for r in s.waiting)
    assert s.num_preemptions == 3 and not any(s.blocks.has_request(r.request_id) for r in s.waiting)
    s.blocks.check_integrity()


# ---- health ----------------------------------------------------------------------------------
class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_loop_with_work_and_no_completed_step_turns_not_ready_after_hung_after_s():
    clock = FakeClock()
    progress = LoopProgress(clock)
    info = StaticInfo(max_num_seqs=4, max_queued=2, block_size=16, max_model_len=128, vocab_size=256, device="cpu")
    snapshot = LoadSnapshot(is_loaded=True)
    status = Watchdog(FakeMemory(used=100), limit_bytes=LIMIT).status

    def beat():
        return build_heartbeat(snapshot, info, progress, status, hung_after_s=10.0)

    assert beat().ready and not beat().is_hung
    clock.now += 60  # idle for a minute: no work, so not hung
    assert beat().ready and beat().last_step_age_s == 60
    progress.record(has_work=False)
    progress.expect_step()  # a step starts and never ends
    clock.now += 9.9
    assert beat().ready
    clock.now += 0.2
    hb = beat()
    assert hb.is_hung and not hb.ready and hb.last_step_age_s == pytest.approx(10.1)
    progress.record(has_work=True)  # the step completed
    assert beat().ready and not beat().is_hung


def test_readiness_needs_loaded_not_draining_and_below_critical():
    progress = LoopProgress()
    info = StaticInfo(max_num_seqs=4, max_queued=2, block_size=16, max_model_len=128, vocab_size=256, device="cpu")
    memory = FakeMemory(used=100)
    watchdog = Watchdog(memory, limit_bytes=LIMIT)

    def beat(**snapshot):
        return build_heartbeat(LoadSnapshot(**snapshot), info, progress, watchdog.status, hung_after_s=10.0)

    assert not beat(is_loaded=False).ready
    hb = beat(is_loaded=True, is_draining=True)
    assert not hb.ready and hb.is_draining
    memory.used = 900
    watchdog.update()
    hb = beat(is_loaded=True)
    assert hb.ready and hb.memory_level == "HIGH" and hb.memory_used_bytes == 900 and hb.memory_limit_bytes == LIMIT
    memory.used = 990
    watchdog.update()
    hb = beat(is_loaded=True)
    assert not hb.ready and hb.memory_level == "CRITICAL"


def test_sigusr1_writes_every_threads_stack_to_the_log(checkpoints, tmp_path):
    config = write_config(tmp_path / "worker.toml", checkpoints["llama"], tmp_path, free_port(), 1,
                          {"gateway": {"worker_endpoint": f"tcp://127.0.0.1:{free_port()}"},
                           "worker": {"num_kv_blocks": 16}})
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "worker", "--worker-id", "worker-0", "--config", str(config)],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for(log_path, proc, lambda text: "ready (incarnation" in text)
        proc.send_signal(signal.SIGUSR1)
        text = _wait_for(log_path, proc, lambda text: "worker/transport.py" in text and "worker/service.py" in text)
        assert "Current thread" in text and text.count("most recent call first") >= 3  # loop, heartbeat, watchdog
        proc.send_signal(signal.SIGTERM)  # and the worker still stops cleanly
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_for(path, proc, predicate, timeout_s: float = 90.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace")
        if predicate(text):
            return text
        assert proc.poll() is None, f"worker exited {proc.returncode}:\n{text}"
        time.sleep(0.1)
    raise AssertionError(f"timed out; log:\n{path.read_text(errors='replace')}")
