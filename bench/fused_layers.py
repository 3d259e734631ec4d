"""`python -m bench.fused_layers`: a single-stream decode step with every decoder layer in one C++
call (worker/model/fused_layers.py) against the same step through the modules, on bench-small
(Llama) and on a random Qwen3 of the same shape (per-head q/k norms; built in a temporary
folder, nothing downloaded). Runs alternate between the two paths; medians are printed with
their ratio."""

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


def compare(model_dir: Path, new_tokens: int, repeats: int) -> tuple[float, float]:
    """(one-call ms, modules ms) per decode step, medians over alternating runs."""
    from worker.engine import Engine
    from worker.model import fused_layers, transformer

    engine = Engine.from_model_dir(model_dir, num_kv_blocks=64)
    one_call = fused_layers.run_fused_layers
    _median_step_ms(engine, 8)  # warm-up
    fused, modules = [], []
    try:
        for _ in range(repeats):
            transformer.run_fused_layers = one_call
            fused.append(_median_step_ms(engine, new_tokens))
            transformer.run_fused_layers = lambda *args: None  # the modules' path
            modules.append(_median_step_ms(engine, new_tokens))
    finally:
        transformer.run_fused_layers = one_call
    return statistics.median(fused), statistics.median(modules)


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
            fused, modules = compare(folder, args.new_tokens, args.repeats)
            print(f"  {name}: one call {fused:.2f} ms, modules {modules:.2f} ms ({modules / fused:.2f}x)")


if __name__ == "__main__":
    main()
