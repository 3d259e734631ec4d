"""`python -m worker`: load a model folder into the engine and run a seeded demo batch.

Until the cluster (gateway + ZeroMQ) lands, this is what the Procfile starts: it shows
the engine loading a checkpoint, batching continuously and reporting its throughput.
"""
from __future__ import annotations

import argparse
import logging
import random
import time

from worker.engine import Engine, SamplingParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m worker", description=__doc__)
    parser.add_argument("--model-dir", required=True, help="local Hugging Face model folder")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    engine = Engine.from_model_dir(args.model_dir, device=args.device)
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 256))] for _ in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - started
    num_generated = sum(len(o.token_ids) for o in outputs)
    print(f"{len(outputs)} requests, {num_generated} tokens generated in {elapsed:.2f} s "
          f"({num_generated / elapsed:.1f} tokens/s); first request's tokens: {outputs[0].token_ids[:16]}")


if __name__ == "__main__":
    main()
