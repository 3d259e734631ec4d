"""Our engine on one weight format, in a fresh process (a process that loaded another format holds
its memory and caches): `python -m bench.ours_decode_child SPEC_JSON OUT_JSON`.

SPEC: model_dir, engine (EngineConfig overrides), decode_tokens and repeats (the single-stream
decode rate, measured as bench/decode_rate.py does: (t(n+1) - t(1)) / n, so prefill cancels),
batched ([sequences, prompt length, new tokens], or null). Writes decode_tok_s, batched_tok_s,
the weight bytes a decode step reads, the fast path's route, whether torch was asked for huge pages and
how much of the process they hold. The process runs under the environment a worker process sets before torch loads
(worker/process_environment.py, the worker settings' defaults); a variable already set wins.
"""
from __future__ import annotations

import os
import time

from shared.config import WorkerConfig
from worker.process_environment import TORCH_HUGE_PAGES, anon_huge_page_bytes, apply_model_process_environment

apply_model_process_environment(WorkerConfig.cpu_huge_pages)

import torch  # noqa: E402  (after the environment: torch reads it at its first allocation)

from bench.json_child import json_child_main  # noqa: E402


def weight_bytes_per_token(model) -> int:
    """Bytes of every tensor a decode step reads in full: the decoder layers' and the head's weights
    as held (packed panels, quantized weights with their scales), not the embedding table, of
    which a step gathers one row, nor the row-major scales and zeros of a layer whose kernels read
    its group columns instead (held beside its panels or inside them)."""
    seen, total = set(), 0
    embedding = model.embed_tokens.weight.untyped_storage().data_ptr()
    for module in model.modules():
        if "scale_columns" in getattr(module, "_buffers", {}) or getattr(module, "columns_in_panels", False):
            seen.update(module._buffers[name].untyped_storage().data_ptr() for name in ("scales", "zeros")
                        if module._buffers.get(name) is not None)
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
                  threads=torch.get_num_threads(), huge_pages=os.environ.get(TORCH_HUGE_PAGES) == "1",
                  huge_page_bytes=anon_huge_page_bytes())
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
