"""The gateway-ceiling benchmark's machinery (bench/gateway_ceiling.py): a fleet of model-free workers
behind one gateway over tcp:// (loopback, so CURVE with the cluster's run-dir keys), the processes
pinned apart, a CPU sampler over /proc, one closed-loop load level measured over its steady window,
and one idle phase (heartbeats only).

CPU is read from /proc (utime + stime, in clock ticks) per process and for the gateway's main thread,
the one that runs its asyncio loop; the machine's per-core busy time comes from psutil. Every figure
is a difference of two samples interpolated at a window's edges, so the sampler's period (0.25 s)
does not round the window. The client's CPU excludes the sampler thread's own.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.cluster_process import STOP_GRACE_S, ClusterProcess, _signal_group, free_port
from bench.contention import foreign_load
from bench.cpu_share import _busy
from bench.load_generator import run_load_async
from bench.load_stats import percentile
from bench.load_workload import LoadSpec, make_load_workload

CLOCK_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
SAMPLE_PERIOD_S = 0.25
CORES = sorted(os.sched_getaffinity(0))  # before any pinning here: the cores this benchmark may use


@dataclass(frozen=True)
class FleetSpec:
    """How a fleet is built and loaded (bench/gateway_ceiling.py's Plan holds one)."""
    step_ms: float = 20.0  # every fake worker step gives each running request one token
    processes: int = 8  # the fleet's workers share at most this many processes
    prompt_tokens: int = 16
    output_tokens: tuple[int, int] = (96, 160)  # max_tokens, uniform; EOS ignored
    requests_per_stream: int = 4  # each closed-loop stream plays this many requests in turn
    warmup_s: float = 1.0  # skipped at a level's start (every stream's first admission at once)
    pin: bool = True  # the gateway on the last core, everything else on the others

    def workers_per_process(self, num_workers: int) -> int:
        return max(1, math.ceil(num_workers / max(1, self.processes)))


# ---- /proc -----------------------------------------------------------------------------------------
def _stat_cpu_s(path: str) -> float:
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * CLOCK_TICK_S  # utime, stime
    except (OSError, IndexError, ValueError):
        return 0.0  # gone: a stopped process adds nothing more


def process_cpu_s(pid: int) -> float:
    return _stat_cpu_s(f"/proc/{pid}/stat")


def thread_cpu_s(pid: int, tid: int) -> float:
    return _stat_cpu_s(f"/proc/{pid}/task/{tid}/stat")


def pin_process(pid: int, cores: set[int]) -> None:
    """Every thread of `pid` onto `cores`; threads it starts later inherit the mask."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class CpuSample:
    t: float  # perf_counter
    gateway: float  # CPU seconds, all its threads
    gateway_main: float  # its main thread's (the asyncio loop)
    fleet: float
    client: float  # this process, less the sampler thread
    cores: list[float]  # busy seconds per core, the whole machine

    def minus(self, other: "CpuSample") -> "CpuSample":
        return CpuSample(self.t - other.t, self.gateway - other.gateway, self.gateway_main - other.gateway_main,
                         self.fleet - other.fleet, self.client - other.client,
                         [a - b for a, b in zip(self.cores, other.cores)])

    def scaled(self, f: float, base: "CpuSample") -> "CpuSample":
        """base + f x (self - base): a point between two samples."""
        d = self.minus(base)
        return CpuSample(base.t + f * d.t, base.gateway + f * d.gateway, base.gateway_main + f * d.gateway_main,
                         base.fleet + f * d.fleet, base.client + f * d.client,
                         [b + f * x for b, x in zip(base.cores, d.cores)])


class CpuSampler:
    """Samples the cluster's and this process's CPU every SAMPLE_PERIOD_S on a thread of its own."""

    def __init__(self, gateway_pid: int, fleet_pids: list[int]):
        self.gateway_pid, self.fleet_pids = gateway_pid, fleet_pids
        self.samples: list[CpuSample] = []
        self._sampler_cpu_s = 0.0  # the sampler thread's own CPU so far
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def sample(self) -> CpuSample:
        own = psutil.Process().cpu_times()
        main = thread_cpu_s(self.gateway_pid, self.gateway_pid)  # before the process's total, which includes it
        return CpuSample(time.perf_counter(), process_cpu_s(self.gateway_pid), main,
                         sum(process_cpu_s(p) for p in self.fleet_pids), own.user + own.system - self._sampler_cpu_s,
                         [_busy(c) for c in psutil.cpu_times(percpu=True)])

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_PERIOD_S):
            self.samples.append(self.sample())
            self._sampler_cpu_s = time.thread_time()

    def __enter__(self) -> "CpuSampler":
        self.samples = [self.sample()]
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self.sample())

    def at(self, t: float) -> CpuSample:
        """The counters at perf_counter time `t`, interpolated between the samples around it."""
        s = self.samples
        after = next((i for i, x in enumerate(s) if x.t >= t), len(s) - 1)
        if after == 0:
            return s[0]
        a, b = s[after - 1], s[after]
        return b.scaled(min(1.0, max(0.0, (t - a.t) / (b.t - a.t))) if b.t > a.t else 1.0, a)


def cpu_figures(d: CpuSample, pinned: bool) -> dict:
    """Shares of one core (CPU seconds / wall seconds) over a window `d` (a difference of samples)."""
    wall = d.t if d.t > 0 else float("nan")
    busy = sum(d.cores)
    ours = d.gateway + d.fleet + d.client
    return {"wall_s": d.t, "gateway_cpu_s": d.gateway, "gateway_main_cpu_s": d.gateway_main, "fleet_cpu_s": d.fleet,
            "client_cpu_s": d.client, "gateway_share": d.gateway / wall, "gateway_main_share": d.gateway_main / wall,
            "fleet_share": d.fleet / wall, "client_share": d.client / wall,
            "core_busy": [c / wall for c in d.cores], "machine_busy_cores": busy / wall,
            "foreign_share": max(0.0, busy - ours) / (wall * len(d.cores)), "pinned": pinned}


# ---- the cluster -----------------------------------------------------------------------------------
class Fleet(ClusterProcess):
    """A gateway and `num_workers` fake workers on a loopback tcp:// endpoint; each fake worker process
    writes its trace into the run dir, so `tokens_sent()` counts every token the fleet sent."""

    def __init__(self, model_dir: Path, num_workers: int, spec: FleetSpec, gateway: dict, max_streams: int,
                 gateway_module: list[str] | None = None):
        sections = {
            "gateway": {"worker_endpoint": f"tcp://127.0.0.1:{free_port()}", "max_concurrent_streams": max_streams,
                        **gateway},
            "queues": {"max_queued_requests": 2 * max_streams},  # every stream's request at once fits
            "worker": {"max_num_seqs": max_streams},  # a worker's room never limits the closed loop
        }
        super().__init__(model_dir, num_workers, sections, gateway_module=gateway_module,
                         worker_module=["bench.fake_worker", "--step-ms", str(spec.step_ms)],
                         workers_per_process=spec.workers_per_process(num_workers))
        self.spec = spec

    def _spawn(self, name: str, module_args: list[str]) -> None:
        if name.startswith("worker"):
            module_args = [*module_args, "--trace", str(self.run_dir / f"{name}.trace.json")]
        super()._spawn(name, module_args)

    def start(self, ready_timeout_s: float = 180.0) -> "Fleet":
        super().start(ready_timeout_s)
        if self.spec.pin and len(CORES) > 1:
            pin_process(self.gateway_pid, {CORES[-1]})
            for pid in [*self.fleet_pids, os.getpid()]:  # the client too, until stop_and_count
                pin_process(pid, set(CORES[:-1]))
        return self

    @property
    def gateway_pid(self) -> int:
        return self.procs["gateway"].pid

    @property
    def fleet_pids(self) -> list[int]:
        return [p.pid for name, p in self.procs.items() if name != "gateway"]

    def sampler(self) -> CpuSampler:
        return CpuSampler(self.gateway_pid, self.fleet_pids)

    def stop_and_count(self) -> int:
        """Stop everything, the workers first (a worker whose gateway is gone waits a second on each send);
        the tokens the workers sent, from their traces (-1 if one is missing)."""
        workers = [p for name, p in self.procs.items() if name != "gateway"]
        for proc in workers:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in workers:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass  # stop() kills it
        self.stop(keep_run_dir=True)
        if self.spec.pin and len(CORES) > 1:
            pin_process(os.getpid(), set(CORES))
        try:
            traces = [self.run_dir / f"{name}.trace.json" for name in self.procs if name != "gateway"]
            if not all(t.exists() for t in traces):
                return -1
            return sum(len(sends) for t in traces for sends in json.loads(t.read_text()).values())
        finally:
            shutil.rmtree(self.run_dir, ignore_errors=True)


# ---- measurements ----------------------------------------------------------------------------------
def wait_for_quiet(max_wait_s: float, threshold: float = 0.10, sample_s: float = 3.0) -> float:
    """Wait (up to max_wait_s) until other processes, seen or not (the whole machine's busy time less
    this process's), use under `threshold` of the cores; returns the last share measured."""
    deadline = time.monotonic() + max_wait_s
    while True:
        record: dict = {}
        with foreign_load(record, "share"):
            time.sleep(sample_s)
        if record["share"] <= threshold or time.monotonic() >= deadline:
            return record["share"]
        print(f"[gateway-ceiling {time.strftime('%H:%M:%S')}] other load {record['share']:.0%} of the cores: "
              f"waiting", file=sys.stderr, flush=True)


def measure_idle(fleet: Fleet, seconds: float) -> dict:
    """Gateway and fleet CPU with every worker idle: the gateway's cost of heartbeats (and its timers)."""
    sampler = fleet.sampler()
    a = sampler.sample()
    time.sleep(seconds)
    return cpu_figures(sampler.sample().minus(a), fleet.spec.pin)


def run_level(fleet: Fleet, concurrency: int, vocab: int, max_model_len: int, seed: int = 0,
              request_timeout_s: float = 300.0) -> dict:
    """`concurrency` closed-loop streams, each playing spec.requests_per_stream requests; measured from
    warmup_s after the start to the moment the last request left (until then every stream is busy)."""
    spec = fleet.spec
    workload = make_load_workload(LoadSpec(
        num_requests=concurrency * spec.requests_per_stream, rate=0.0, long_fraction=0.0,
        short_prompt=(spec.prompt_tokens, spec.prompt_tokens), short_output=spec.output_tokens,
        urgent_fraction=0.0, seed=seed), vocab, max_model_len)
    with fleet.sampler() as sampler:
        result = asyncio.run(run_load_async(fleet.address, workload, concurrency=concurrency, poll_status=False,
                                            request_timeout_s=request_timeout_s,
                                            request_prefix=f"c{concurrency}s{seed}"))
    records, t0 = result.records, result.extra["t0_perf_counter"]
    start = spec.warmup_s
    end = max(r.sent_s for r in records if r.sent_s is not None)
    if end - start < 4 * SAMPLE_PERIOD_S:  # too short to have a steady part: the whole run instead
        start, end = 0.0, result.wall_s
    inside = [(t, n) for r in records for t, n in r.chunks if start <= t < end]
    tokens, messages = sum(n for _, n in inside), len(inside)
    cpu = cpu_figures(sampler.at(t0 + end).minus(sampler.at(t0 + start)), spec.pin)
    window_s = end - start
    sent_inside = [r for r in records if r.ok and start <= (r.sent_s or -1.0) < end]
    ttft = [r.ttft_s * 1e3 for r in sent_inside if r.ttft_s is not None]
    dispatch = [r.server_queue_ms for r in sent_inside if r.server_queue_ms is not None]
    itl = [x * 1e3 for r in sent_inside for x in r.itl_samples()]

    def per_token_us(cpu_s: float) -> float | None:
        return cpu_s / tokens * 1e6 if tokens else None

    done = [r for r in records if r.ok]
    return {
        "concurrency": concurrency, "offered_tokens_per_s": concurrency * 1e3 / spec.step_ms,
        "window_s": window_s, "tokens": tokens, "messages": messages,
        "tokens_per_s": tokens / window_s if window_s > 0 else 0.0,
        "tokens_per_message": tokens / messages if messages else None,
        "gateway_us_per_token": per_token_us(cpu["gateway_cpu_s"]),
        "gateway_main_us_per_token": per_token_us(cpu["gateway_main_cpu_s"]),
        "client_us_per_token": per_token_us(cpu["client_cpu_s"]),
        "fleet_us_per_token": per_token_us(cpu["fleet_cpu_s"]),
        "dispatch_ms_p50": percentile(dispatch, 50), "dispatch_ms_p99": percentile(dispatch, 99),
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
        "itl_ms_p50": percentile(itl, 50), "itl_ms_p99": percentile(itl, 99),
        "requests": len(records), "completed": len(done),
        "errors": {e: sum(r.error == e for r in records) for e in {r.error for r in records if r.error}},
        # Every finished request carried exactly its max_tokens (EOS ignored): nothing lost or doubled.
        "exact_requests": sum(r.num_tokens == r.max_tokens for r in done),
        "tokens_received": sum(r.num_tokens for r in records), "run_wall_s": result.wall_s, "cpu": cpu,
    }
