"""`python -m bench.fused_layers`: a single-stream decode step through the CPU fast path
(worker/model/cpu_fast_path.py) with every decoder layer in one C++ call, against the same step
through the fast path kernel by kernel (the route a quantized model takes) and through the
plain torch modules (over the served weights, which the fast path holds as packed panels only,
so the modules rebuild each float weight as they use it), on bench-small (Llama) and on a
random Qwen3 of the same shape (per-head q/k norms; built in a temporary folder, nothing
downloaded). Runs alternate between the routes; medians are printed with the ratios against
the one call."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.checkpoints import BENCH_SMALL, SEED, ensure_bench_small

PROMPT_LEN = 128


def _qwen3_like_bench_small(folder: Path) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(SEED)
    Qwen3ForCausalLM(Qwen3Config(**BENCH_SMALL, head_dim=64, dtype="float32")).save_pretrained(folder)
    return folder


def _median_step_ms(engine, new_tokens: int) -> float:
    from worker.engine import SamplingParams

    engine.add_request("r", list(range(3, 3 + PROMPT_LEN)),
                       SamplingParams(max_tokens=new_tokens + 1, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompt
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


ROUTES = ("one call", "kernel by kernel", "modules")


def compare(model_dir: Path, new_tokens: int, repeats: int) -> dict[str, float]:
    """Median ms per decode step for each route, over alternating runs."""
    from worker.engine import Engine
    from worker.model import cpu_kernels
    from worker.model.cpu_fast_path import CpuFastPath

    engine = Engine.from_model_dir(model_dir, num_kv_blocks=64)
    one_call = engine.runner.fast_path
    assert one_call is not None, "the engine chose no CPU fast path (see its 'fast path:' log line)"
    routes = {"one call": one_call, "kernel by kernel": CpuFastPath(engine.model, cpu_kernels.load(), one_call=False),
              "modules": None}
    engine.runner.fast_path = one_call
    _median_step_ms(engine, 8)  # warm-up
    times: dict[str, list[float]] = {route: [] for route in ROUTES}
    for _ in range(repeats):
        for route in ROUTES:
            engine.runner.fast_path = routes[route]
            times[route].append(_median_step_ms(engine, new_tokens))
    return {route: statistics.median(samples) for route, samples in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; single stream, {PROMPT_LEN}-token prompt, "
          f"median decode step over {args.new_tokens} tokens, {args.repeats} alternating runs")
    with tempfile.TemporaryDirectory() as tmp:
        for name, folder in (("bench-small (Llama)", ensure_bench_small()),
                             ("Qwen3, bench-small's shape", _qwen3_like_bench_small(Path(tmp) / "qwen3"))):
            ms = compare(folder, args.new_tokens, args.repeats)
            base = ms["one call"]
            print(f"  {name}: " + ", ".join(f"{route} {ms[route]:.2f} ms ({ms[route] / base:.2f}x)" for route in ROUTES))


if __name__ == "__main__":
    main()
