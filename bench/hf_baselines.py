"""The transformers baselines: static-batch `generate()` with left padding, transformers' own continuous batching
manager, and batch-1 decode — each timed on the same workload and checkpoint as our engine."""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from bench.run_result import RunResult, Timed
from bench.workload import Request

PAD_ID = 0  # the random checkpoint has no pad token; any id works because the attention mask hides it


def load_hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    # sdpa is transformers' fastest CPU attention, and the one its continuous batching accepts besides paged|eager.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def _left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


@torch.inference_mode()
def _generate_static(model, batch: list[Request]) -> list[list[int]]:
    ids, mask = (t.to(model.device) for t in _left_pad([r.prompt_token_ids for r in batch]))
    n = max(r.output_len for r in batch)
    # min_new_tokens == max_new_tokens: EOS is suppressed, so every row runs the full batch length.
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=PAD_ID)
    gen = out[:, ids.shape[1]:]
    return [gen[i, : r.output_len].tolist() for i, r in enumerate(batch)]


def run_static_generate(model, requests: list[Request], warmup: list[Request], batch_size: int = 8,
                        timed: Timed = nullcontext) -> RunResult:
    """(a) What most people write: fixed batches in arrival order, each padded to its longest prompt and run to its
    longest output. Only each request's own output length counts as useful."""
    _generate_static(model, warmup)
    outputs: list[list[int]] = []
    with timed():
        t0 = time.perf_counter()
        for i in range(0, len(requests), batch_size):
            outputs += _generate_static(model, requests[i:i + batch_size])
        wall = time.perf_counter() - t0
    return RunResult(f"HF generate (static batch {batch_size})", wall,
                     sum(r.output_len for r in requests), outputs)


def _cb_configs(requests: list[Request], max_batch_tokens: int, max_requests: int, page_size: int):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    # Size the paged cache to hold every request at once (plus slack), so it never evicts: the most favourable
    # setting for the baseline, and it keeps the cache from defaulting to 60% of host RAM.
    blocks = sum(-(-(len(r.prompt_token_ids) + r.output_len) // page_size) for r in requests) + 4
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in requests),
                               eos_token_id=-1, pad_token_id=PAD_ID)
    cb_cfg = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests,
        allow_block_sharing=False,    # the prompts are random: prefix caching could only add overhead
        auto_switch_to_flash=False,   # no flash-attn on CPU; keep sdpa explicitly
        use_cuda_graph=False,
    )
    return gen_cfg, cb_cfg


def _cb_round(manager, requests: list[Request], prefix: str, timeout_s: float) -> list[list[int]]:
    # add_request takes a per-request max_new_tokens (generate_batch only takes one for all), and eos_token_id=-1
    # means no EOS stop, so each request generates exactly its own length.
    ids = [manager.add_request(r.prompt_token_ids, request_id=f"{prefix}{i}", max_new_tokens=r.output_len,
                               eos_token_id=-1) for i, r in enumerate(requests)]
    results = {}
    deadline = time.perf_counter() + timeout_s
    while len(results) < len(ids):
        out = manager.get_result(timeout=0.5)
        if out is not None and out.is_finished():
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            results[out.request_id] = out.generated_tokens
        elif out is None and not manager.is_running():
            raise RuntimeError("the continuous batching thread stopped before all requests finished")
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{len(results)}/{len(ids)} requests finished within {timeout_s:.0f}s")
    return [results[i] for i in ids]


def run_continuous_batching(model, requests: list[Request], warmup: list[Request], max_batch_tokens: int,
                            max_requests: int, page_size: int = 256, timeout_s: float = 1800,
                            timed: Timed = nullcontext) -> RunResult:
    """(b) transformers' own continuous batching: the manager API with per-request max_new_tokens, attention "sdpa"
    over its paged cache (flash kernels need CUDA). Failures are reported, not raised."""
    name = "HF continuous batching"
    notes: list[str] = []
    manager = None
    try:
        gen_cfg, cb_cfg = _cb_configs(requests, max_batch_tokens, max_requests, page_size)
        manager = model.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb_cfg)
        # The generation thread adopts the caller's inference mode at start(), so start it inside.
        with torch.inference_mode():
            manager.start()
            _cb_round(manager, warmup, "warm", timeout_s)
            with timed():
                t0 = time.perf_counter()
                outputs = _cb_round(manager, requests, "req", timeout_s)
                wall = time.perf_counter() - t0
        bad = [i for i, (o, r) in enumerate(zip(outputs, requests)) if len(o) != r.output_len]
        if bad:
            notes.append(f"{len(bad)} requests did not return exactly their output length (e.g. #{bad[0]})")
        return RunResult(name, wall, sum(min(len(o), r.output_len) for o, r in zip(outputs, requests)),
                         outputs, notes)
    except Exception as e:  # the baseline is optional on CPU: report why and let the benchmark go on
        return RunResult(name, 0.0, 0, None, notes, error=f"{type(e).__name__}: {e}")
    finally:
        if manager is not None:
            try:
                manager.stop(block=True, timeout=30)
                manager.destroy()
            except Exception:
                pass


@torch.inference_mode()
def hf_decode_seconds(model, prompt: list[int], new_tokens: int) -> float:
    ids = torch.tensor([prompt], device=model.device)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD_ID)
    out.tolist()  # waits for the device's queue: the tokens are in hand
    return time.perf_counter() - t0
