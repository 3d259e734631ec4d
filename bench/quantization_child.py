"""One quantization/loading-mode variant measured in a fresh process (peak memory and load
time mean nothing in a process that already loaded another variant).

    python -m bench.quantization_child SPEC_JSON OUT_JSON

SPEC: model_dir, engine (EngineConfig overrides), prompts (token-id lists for the greedy
comparison), match_tokens, single (prompt length, new tokens), batched (requests, new tokens),
heldout (score the model folder's heldout_sample.txt). Writes one JSON record.
"""
from __future__ import annotations

import itertools
import resource
import time
from pathlib import Path

import torch

from bench.json_child import json_child_main


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _stretch(prompt: list[int], length: int) -> list[int]:
    return (prompt * (length // len(prompt) + 1))[:length]


def _tokens_per_s(engine, prompts: list[list[int]], new_tokens: int, repeats: int = 3) -> float:
    """The best of `repeats` runs: this VM's timings wobble by tens of percent run to run, and
    the fastest run is the one least disturbed."""
    from worker.engine import SamplingParams
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    best = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        outputs = engine.generate(prompts, params, use_tqdm=False)
        best = max(best, sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - started))
    return best


def measure(spec: dict) -> dict:
    from worker.engine import Engine, SamplingParams
    from worker.model import cpu_kernels
    cpu_kernels.load()  # built already; loading it is not the model's load time
    rss_before = _rss_peak_bytes()
    started = time.perf_counter()
    engine = Engine.from_model_dir(spec["model_dir"], **spec["engine"])
    init_s = time.perf_counter() - started
    rss_after_load = _rss_peak_bytes()
    model = engine.model
    # The tensors the model computes from, as held (a released float Linear holds its packed
    # panels): state_dict() would rebuild [N, K] copies of those and inflate the peak RSS.
    held = itertools.chain(model.named_parameters(), model.named_buffers())
    weights = [t for name, t in held if not name.startswith("rotary.")]
    config = engine.model_config
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * engine.kv_caches[0][0].element_size()
    record = dict(
        init_s=init_s, load_s=getattr(engine, "load_seconds", None),
        weight_bytes=_unique_bytes(weights), kv_bytes_per_token=kv_per_token,
        kv_pool_bytes=sum(k.nbytes + v.nbytes for k, v in engine.kv_caches),
        calibration=(dict(engine.calibration.info, summary=engine.calibration.summary())
                     if engine.calibration is not None else None),
        quantized=(engine.quantization_report.num_quantized if engine.quantization_report else None),
        paths=(engine.quantization_report.paths if engine.quantization_report else None),
    )
    prompts = spec["prompts"]
    params = SamplingParams(max_tokens=spec["match_tokens"], temperature=0.0, ignore_eos=True)
    record["greedy"] = [list(o.token_ids) for o in engine.generate(prompts, params, use_tqdm=False)]
    length, new = spec["single"]
    _tokens_per_s(engine, [_stretch(prompts[0], length)], 8, repeats=1)  # warm-up: first-call costs are not the steady rate
    record["single_tok_s"] = _tokens_per_s(engine, [_stretch(prompts[0], length)], new)
    count, new = spec["batched"]
    batch = [_stretch(prompts[i % len(prompts)], length - i) for i in range(count)]
    record["batched_tok_s"] = _tokens_per_s(engine, batch, new)
    heldout = Path(spec["model_dir"]) / "heldout_sample.txt"
    if spec.get("heldout") and heldout.is_file():
        from tokenizers import Tokenizer

        from worker.scoring import score
        ids = Tokenizer.from_file(str(Path(spec["model_dir"]) / "tokenizer.json")).encode(heldout.read_text()).ids
        record["perplexity"] = score(model, ids, window=min(512, config.max_position_embeddings),
                                     fast_path=engine.runner.fast_path).perplexity
    record.update(rss_before_load=rss_before, rss_peak_load=rss_after_load, rss_peak=_rss_peak_bytes(),
                  threads=torch.get_num_threads())
    return record


if __name__ == "__main__":
    json_child_main(measure)
