"""Weight-only INT8 held as panels against row-major, whole engine, a few streams at once:
`python -m bench.int8_streams [--model tinyllama-shape|bench-small|DIR] [--streams 1,2,4,8,16,32]
[--baseline row-major|plain-panels]`.

Two engines on the same checkpoint in one process, one holding its INT8 weights as the float
tiles' panels (what the engine builder does on our CPU kernels: on AVX-512, pairs of panels
interleaved by input feature), one keeping them row-major (or, with `--baseline plain-panels`,
holding the plain [P, K, 16] panels, one stream a panel); their `generate` runs alternate, so a
host whose memory rate drifts by the minute hits both.
Prints generated tokens over each run's time (median of the rounds) and whether the greedy
tokens agree. The process runs under a worker's environment (huge pages as configured).
"""
from __future__ import annotations

import argparse
import statistics
import time

from shared.config import WorkerConfig
from worker.process_environment import apply_model_process_environment

apply_model_process_environment(WorkerConfig.cpu_huge_pages)

import worker.engine_builder as engine_builder  # noqa: E402  (after the environment)
import worker.model.quantization as quantization  # noqa: E402
from bench.checkpoints import SHAPES, ensure_checkpoint  # noqa: E402
from worker.engine import Engine, SamplingParams  # noqa: E402
from worker.model.quantization import QuantizedLinear  # noqa: E402

BASELINES = {"row-major": "row-major", "plain-panels": "plain panels"}


def held_layers(engine: Engine) -> tuple[int, int]:
    """(INT8 layers holding panels, INT8 layers)."""
    layers = [m for m in engine.model.modules() if isinstance(m, QuantizedLinear) and m.bits == 8]
    return sum(m.held_panels == "weight" for m in layers), len(layers)


def panel_groups(engine: Engine) -> set[int]:
    """The panels per group of the INT8 layers held as panels (1: plain [P, K, 16])."""
    return {m.qweight_panels.shape[2] if m.qweight_panels.dim() == 4 else 1 for m in engine.model.modules()
            if isinstance(m, QuantizedLinear) and m.held_panels == "weight"}


def build_engines(model_dir: str, threads: int, baseline: str = "row-major") -> dict[str, Engine]:
    settings = dict(device="cpu", num_threads=threads, quantization_calibration="none", num_kv_blocks=256,
                    max_num_seqs=32, quantization="mixed", quantization_rule="*:int8,head:int8")
    held = Engine.from_model_dir(model_dir, **settings)
    if baseline == "row-major":  # this engine keeps the row-major weights
        module, name, replacement = engine_builder, "hold_weight_panels", lambda model: 0
    else:  # this engine holds plain panels
        pack = quantization.pack_panels
        module, name, replacement = quantization, "pack_panels", lambda weight, group=1: pack(weight)
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        other = Engine.from_model_dir(model_dir, **settings)
    finally:
        setattr(module, name, original)
    return {BASELINES[baseline]: other, "held panels": held}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tinyllama-shape",
                        help="a benchmark checkpoint's name (made in .cache/ if missing) or a model folder")
    parser.add_argument("--streams", default="1,2,4,8,16,32")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline", choices=sorted(BASELINES), default="row-major")
    args = parser.parse_args()
    model_dir = str(ensure_checkpoint(args.model)) if args.model in SHAPES else args.model
    engines = build_engines(model_dir, args.threads, args.baseline)
    print(f"{model_dir}: weight-only INT8 (head INT8), 16-token prompts, {args.new_tokens} new tokens, "
          f"median of {args.rounds} alternating rounds; INT8 layers held as panels: "
          + ", ".join(f"{name} {'%d of %d' % held_layers(engine)}" for name, engine in engines.items())
          + "; panels per group: " + ", ".join(f"{name} {sorted(panel_groups(engine))}"
                                               for name, engine in engines.items()))
    for streams in [int(v) for v in args.streams.split(",")]:
        prompts = [[5 + i] * 16 for i in range(streams)]
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        rates = {name: [] for name in engines}
        tokens = {}
        for engine in engines.values():
            engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        for i in range(args.rounds):
            for name in (list(engines) if i % 2 == 0 else list(engines)[::-1]):
                engines[name].evict_prefix_cache()
                start = time.perf_counter()
                outputs = engines[name].generate(prompts, params, use_tqdm=False)
                rates[name].append(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start))
                tokens[name] = [o.token_ids for o in outputs]
        baseline, held = (statistics.median(rates[name]) for name in engines)
        same = sum(a == b for a, b in zip(*tokens.values()))
        print(f"  {streams:3d} streams: {BASELINES[args.baseline]} {baseline:7.1f} tok/s, held panels {held:7.1f} "
              f"tok/s, {held / baseline:.2f}x (greedy identical {same}/{streams})", flush=True)


if __name__ == "__main__":
    main()
