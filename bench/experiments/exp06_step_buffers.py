"""Experiment 6: the runner's preallocated step buffers against allocating them at every step.

Owns `AllocatingRunner`, a ModelRunner whose only change is that the input staging buffers and
the logits buffer are allocated afresh before each step (what a loop that calls torch.zeros per
step does), and the memory trace: resident set (CPU) or the caching allocator's reserved bytes
(CUDA) after each of 1,000 steps of a varying closed-loop workload.
"""

from __future__ import annotations

import random
import statistics
import time

import psutil
import torch

from bench.experiments import plotting
from bench.experiments.common import (DEFAULT_MODEL_DIR, FIRST_ORDINARY_ID, Result, greedy, make_engine, times,
                                      vocab_size, warm_up)
from worker.model_runner import ModelRunner

NUMBER, NAME = 6, "step_buffers"
TITLE = "Preallocated step buffers vs allocating per step"
IN_FLIGHT = 16
MIB = 2**20


class AllocatingRunner(ModelRunner):
    """Allocates the step buffers per step instead of once; everything else is the parent's code."""

    def _prepare(self, seqs):
        self._host = {name: torch.zeros_like(t) for name, t in self._host.items()}
        self._device = (self._host if self.device.type == "cpu"
                        else {name: torch.zeros_like(t, device=self.device) for name, t in self._host.items()})
        self.logits = torch.zeros_like(self.logits)
        self.index_buffers()
        self.bytes_allocated_per_step = step_buffer_bytes(self)
        return super()._prepare(seqs)


def step_buffer_bytes(runner: ModelRunner) -> int:
    """Bytes of the buffers a step writes into: what the allocating variant allocates every step."""
    host = sum(t.nbytes for t in runner._host.values())
    device = 0 if runner._device is runner._host else sum(t.nbytes for t in runner._device.values())
    return host + device + runner.logits.nbytes


def use_allocating_runner(engine) -> None:
    old = engine.runner
    engine.runner = AllocatingRunner(old.model, old.kv_caches, old.block_size, old.max_num_tokens, old.max_num_seqs,
                                     old.max_blocks_per_seq * old.block_size, old.sampler, old.attention_fn,
                                     max_draft_tokens=old.max_draft_tokens)


def memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device)
    return psutil.Process().memory_info().rss


def trace(engine, vocab: int, num_steps: int, seed: int = 6) -> dict:
    """Keep IN_FLIGHT requests of varied lengths running for num_steps steps; memory after every step."""
    rng = random.Random(seed)
    next_id = 0

    def add() -> None:
        nonlocal next_id
        prompt = [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(rng.randint(16, 300))]
        engine.add_request(f"s{seed}-{next_id}", prompt, greedy(rng.randint(8, 128)))
        next_id += 1

    for _ in range(IN_FLIGHT):
        add()
    memory, step_s = [], []
    start = memory_bytes(engine.device)
    for _ in range(num_steps):
        t0 = time.perf_counter()
        outputs = engine.step()
        step_s.append(time.perf_counter() - t0)
        memory.append(memory_bytes(engine.device) - start)
        for o in outputs:
            if o.finished:
                add()
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    engine.step()
    return {"memory_delta": memory, "step_ms_p50": statistics.median(step_s) * 1e3, "start_bytes": start}


def run(quick: bool = False) -> Result:
    model_dir = DEFAULT_MODEL_DIR
    vocab = vocab_size(model_dir)
    num_steps = 200 if quick else 1000
    results = {}
    for name in ("preallocated (this engine)", "allocated every step"):
        engine = make_engine(model_dir, max_num_seqs=32, max_num_batched_tokens=1024, enable_prefix_caching=False)
        if name == "allocated every step":
            use_allocating_runner(engine)
        warm_up(engine, vocab)
        results[name] = trace(engine, vocab, num_steps)
        results[name]["buffer_bytes"] = step_buffer_bytes(engine.runner)
        allocating = name == "allocated every step"
        results[name]["allocated_per_step"] = results[name]["buffer_bytes"] if allocating else 0
        device = engine.device
        del engine
    pre, alloc = results.values()
    rows = [[name, r["allocated_per_step"] / 1024, max(r["memory_delta"]) / MIB, r["memory_delta"][-1] / MIB,
             r["step_ms_p50"], times(pre["step_ms_p50"] / r["step_ms_p50"])] for name, r in results.items()]
    what = "reserved by the CUDA allocator" if device.type == "cuda" else "resident set"
    return Result(
        headers=["step buffers", "KiB allocated per step", f"peak growth MiB ({what})",
                 f"growth after {num_steps} steps MiB", "step ms p50", "speed vs preallocated"],
        rows=rows,
        headline=(f"over {num_steps} steps the {what} grows {max(pre['memory_delta']) / MIB:.1f} MiB at most with "
                  f"preallocated buffers and {max(alloc['memory_delta']) / MIB:.1f} MiB allocating "
                  f"{alloc['allocated_per_step'] / 1024:.0f} KiB per step; step time "
                  f"{pre['step_ms_p50']:.2f} vs {alloc['step_ms_p50']:.2f} ms"),
        data={"runs": results, "num_steps": num_steps, "device": device.type, "what": what})


def plot(data: dict, path) -> None:
    fig, (ax,) = plotting.figure(1, f"Experiment 6: memory over {data['num_steps']} steps ({data['device']})",
                                 width_in=7.5)
    for name, r in data["runs"].items():
        ax.plot(range(1, len(r["memory_delta"]) + 1), [m / MIB for m in r["memory_delta"]], label=name)
    ax.set_xlabel("engine step")
    ax.set_ylabel(f"{data['what']} growth since step 0, MiB")
    ax.legend(fontsize=8)
    plotting.save(fig, path)
