"""Our engine on one weight format, in a fresh process (a process that loaded another format holds
its memory and caches): `python -m bench.ours_decode_child SPEC_JSON OUT_JSON`.

SPEC: model_dir, engine (EngineConfig overrides), decode_tokens and repeats (the single-stream
decode rate, measured as bench/decode_rate.py does: (t(n+1) - t(1)) / n, so prefill cancels),
batched ([sequences, prompt length, new tokens], or null). Writes decode_tok_s, batched_tok_s,
the weight bytes a decode step reads and the fast path's route.
"""
from __future__ import annotations

import time

import torch

from bench.json_child import json_child_main


def weight_bytes_per_token(model) -> int:
    """Bytes of every tensor a decode step reads in full: the decoder layers' and the head's weights
    as held (packed panels, quantized weights with their scales), not the embedding table, of
    which a step gathers one row."""
    seen, total = set(), 0
    embedding = model.embed_tokens.weight.untyped_storage().data_ptr()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        key = t.untyped_storage().data_ptr()
        if name.startswith("rotary.") or key == embedding or key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def measure(spec: dict) -> dict:
    from bench.decode_rate import measure_decode_rate
    from bench.engine_runs import engine_decode_seconds
    from worker.engine import Engine, SamplingParams

    engine = Engine.from_model_dir(spec["model_dir"], **spec["engine"])
    vocab = engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (4,), generator=generator).tolist()
    rate = measure_decode_rate(lambda p, n: engine_decode_seconds(engine, p, n), prompt, spec["decode_tokens"],
                               repeats=spec["repeats"])
    fast_path = engine.runner.fast_path
    record = dict(decode_tok_s=rate.tokens_per_s, step_ms=1000.0 / rate.tokens_per_s if rate.tokens_per_s else None,
                  weight_bytes_per_token=weight_bytes_per_token(engine.model),
                  route=fast_path.describe() if fast_path is not None else "modules",
                  threads=torch.get_num_threads())
    if spec.get("batched"):
        sequences, prompt_len, new_tokens = spec["batched"]
        prompts = [torch.randint(3, vocab, (prompt_len,), generator=generator).tolist() for _ in range(sequences)]
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
        engine.evict_prefix_cache()
        started = time.perf_counter()
        outputs = engine.generate(prompts, params, use_tqdm=False)
        record["batched_tok_s"] = sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - started)
    return record


if __name__ == "__main__":
    json_child_main(measure)
