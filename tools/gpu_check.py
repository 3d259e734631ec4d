"""The CUDA paths the CPU-only test suite cannot reach, checked in one short run on a GPU host.

    python -m tools.gpu_check              # on a machine with CUDA (a minute or two)
    python -m tools.gpu_check --device cpu # the same checks on the CPU: a dry run of this script

Each check prints PASS or FAIL with what it measured; the exit status is the number of
failures. Covers: the engine on CUDA in the checkpoint's half type against float32 on the
CPU, the runner's own CUDA stream, KV sizing from free device memory, the memory reader's
CUDA figures, the sharded and on-demand loading modes (pinned memory, side stream, events)
against full loading, INT8/INT4 on the device (the compute path `choose_path` picked), speculative
decoding's verify steps, a float16 KV pool beside the model's own dtype, the reference
attention on the device, decode steps replayed from CUDA graphs against eager ones, and sampling
on the device (torch's path: seeded runs reproduce, draws follow a known distribution).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import traceback
from pathlib import Path

import torch

MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "default"
TEXTS = ["The json module", "Return the number of items", "A list is", "Open a file and"]


def _prompts() -> list[list[int]]:
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    return [tokenizer.encode(t).ids for t in TEXTS]


def _greedy(engine, prompts, n=24) -> list[list[int]]:
    from worker.engine import SamplingParams
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [list(o.token_ids) for o in engine.generate(prompts, params, use_tqdm=False)]


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q))
    return same / max(1, sum(len(p) for p in a))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    from worker.engine import Engine
    from worker.memory import MemoryReader
    from worker.model.quantization import QuantizedLinear
    from worker.scoring import window_logprobs

    device = args.device
    prompts = _prompts()
    failures = 0

    def check(name: str, fn) -> None:
        nonlocal failures
        started = time.perf_counter()
        try:
            ok, detail = fn()
        except Exception:  # a check that crashes is a failed check; the others still run
            ok, detail = False, traceback.format_exc(limit=3)
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name} ({time.perf_counter() - started:.1f} s): {detail}", flush=True)

    reference_engine = Engine.from_model_dir(MODEL_DIR, device="cpu", num_kv_blocks=256)
    reference = _greedy(reference_engine, prompts)
    reference_logprobs = window_logprobs(reference_engine.model, prompts[0] * 8)
    state: dict = {}

    def half_precision():
        engine = state["full"] = Engine.from_model_dir(MODEL_DIR, device=device)  # KV sized from free memory
        dtype = next(engine.model.parameters()).dtype
        drift = (window_logprobs(engine.model, prompts[0] * 8).cpu() - reference_logprobs).abs().max().item()
        agreement = _agreement(reference, _greedy(engine, prompts))
        cudnn = "on" if torch.backends.cuda.cudnn_sdp_enabled() else "off"
        return (drift < 0.1 and agreement >= 0.75,
                f"{dtype}, {engine.block_manager.num_blocks} KV blocks, cuDNN attention {cudnn}, max |dlogprob| vs "
                f"float32 CPU {drift:.4f}, greedy agreement {agreement:.0%}")

    def runner_stream():
        engine = state["full"]
        stream = engine.runner.stream
        wanted = isinstance(stream, torch.cuda.Stream) if device.startswith("cuda") else stream is None
        return wanted, f"runner stream {stream}"

    def memory_reader():
        engine = state["full"]
        reading = MemoryReader(engine.device)(detailed=True)
        on_cuda = device.startswith("cuda")
        ok = reading.used_bytes > 0 and reading.total_bytes > 0 and (not on_cuda or reading.allocated_bytes > 0)
        return ok, str(reading)

    def loading_mode(mode: str, against: str = "full", **extra):
        def run():
            engine = Engine.from_model_dir(MODEL_DIR, device=device if mode != "sharded" else "auto",
                                           num_kv_blocks=256, load_mode=mode, **extra)
            # Quantized layers may compute by another path on demand, so agreement, not identity, there.
            agreement = _agreement(_greedy(state[against], prompts), _greedy(engine, prompts))
            return agreement >= (1.0 if against == "full" else 0.9), (
                f"greedy agreement with {against} loading {agreement:.0%}; load {engine.load_seconds:.2f} s")
        return run

    def quantized(preset: str):
        def run():
            engine = state[preset] = Engine.from_model_dir(MODEL_DIR, device=device, num_kv_blocks=256,
                                                           quantization=preset)
            paths = sorted({m.path for m in engine.model.modules() if isinstance(m, QuantizedLinear)})
            agreement = _agreement(_greedy(state["full"], prompts), _greedy(engine, prompts))
            graphs = engine.runner.decode_graphs
            off = f" (off: {graphs.disabled})" if graphs is not None and graphs.disabled else ""
            captured = f"{graphs.num_captures} graphs captured{off}" if graphs is not None else "no graphs"
            return agreement >= 0.5, f"paths {paths}, {captured}, greedy agreement with float {agreement:.0%}"
        return run

    def speculative():
        # Drafts verified on the device: the verify step runs the multi-token attention path, whose
        # half-precision sums may round apart from the decode path's, so agreement rather than identity.
        engine = Engine.from_model_dir(MODEL_DIR, device=device, num_kv_blocks=256, speculative_ngram_k=6)
        copying = [p * 6 for p in prompts]  # repeated text: prompt lookup finds drafts at once
        plain = _greedy(state["full"], copying, n=64)
        drafted = _greedy(engine, copying, n=64)
        stats = engine.stats()
        agreement = _agreement(plain, drafted)
        engine.check_integrity()
        graphs = engine.runner.decode_graphs
        from_graphs = (f"{graphs.num_draft_steps} verify steps from graphs (off: {graphs.drafts_disabled})"
                       if graphs is not None else "no graphs")
        return (agreement >= (0.9 if device.startswith("cuda") else 1.0) and stats.num_spec_accepted_tokens > 0,
                f"greedy agreement with plain decoding {agreement:.0%}; {stats.num_spec_accepted_tokens} of "
                f"{stats.num_spec_draft_tokens} draft tokens accepted; {stats.num_steps} steps for "
                f"{sum(map(len, drafted))} tokens; {from_graphs}")

    def kv_cache_dtype():
        # A pool type other than the compute dtype (bfloat16 on CUDA): every read casts, every write rounds.
        engine = Engine.from_model_dir(MODEL_DIR, device=device, num_kv_blocks=256, kv_cache_dtype="float16")
        kv_dtype = engine.kv_caches[0][0].dtype
        agreement = _agreement(_greedy(state["full"], prompts), _greedy(engine, prompts))
        return kv_dtype == torch.float16 and agreement >= 0.75, (
            f"KV {kv_dtype}, greedy agreement with the model's own KV dtype {agreement:.0%}")

    def reference_attention():
        # The per-sequence attention the tests trust, on the device (its masks must be made there),
        # against the batched one on the same teacher-forced window: greedy decoding in half
        # precision parts at the first near-tie, so the logprobs are what is compared.
        from worker.model.attention import paged_attention_reference
        model = state["full"].model
        window = prompts[0] * 8
        drift = (window_logprobs(model, window, attention_fn=paged_attention_reference)
                 - window_logprobs(model, window)).abs().max().item()
        return drift < 0.05, f"max |dlogprob| against the batched attention {drift:.4f}"

    def decode_graphs():
        # Decode steps replayed from captured graphs against the same steps run eagerly.
        graphed = state["full"]
        eager = Engine.from_model_dir(MODEL_DIR, device=device, num_kv_blocks=256, cuda_graphs=False)
        agreement = _agreement(_greedy(eager, prompts), _greedy(graphed, prompts))
        rates = {}
        for name, engine in (("eager", eager), ("graphs", graphed)):
            _greedy(engine, prompts[:1], n=8)
            started = time.perf_counter()
            tokens = sum(map(len, _greedy(engine, prompts[:1], n=64)))
            rates[name] = tokens / (time.perf_counter() - started)
        graphs = graphed.runner.decode_graphs
        on_cuda = device.startswith("cuda")
        replays = graphs.num_replays if graphs is not None else 0
        ok = agreement >= 0.9 and (not on_cuda or (replays > 0 and graphs.disabled is None))
        return ok, (f"{graphs.num_captures if graphs else 0} graphs captured, {replays} replays, off: "
                    f"{graphs.disabled if graphs else 'no graphs'}; greedy agreement "
                    f"with eager steps {agreement:.0%}; one stream {rates['graphs']:.0f} tok/s with graphs, "
                    f"{rates['eager']:.0f} eager")

    def sampling():
        # Torch's path, the only one on the device: one uniform a row from the row's own stream.
        from worker.engine import SamplingParams
        from worker.sampler import Sampler, SamplingBatch
        engine = state["full"]
        params = SamplingParams(max_tokens=24, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1,
                                presence_penalty=0.3, seed=7, ignore_eos=True)
        runs = [[list(o.token_ids) for o in engine.generate(prompts, params, use_tqdm=False)] for _ in range(2)]
        other = [list(o.token_ids) for o in engine.generate(prompts, dataclasses.replace(params, seed=8), use_tqdm=False)]
        probs, draws = [0.1, 0.2, 0.3, 0.4], 4000
        logits = torch.tensor(probs).log().repeat(draws, 1).to(device)
        batch = SamplingBatch(params=[SamplingParams()] * draws, generators=[None] * draws,
                              token_histories=[[]] * draws)
        tokens = Sampler(device, seed=0)(logits, batch).token_ids
        chi2 = sum((tokens.count(i) - draws * p) ** 2 / (draws * p) for i, p in enumerate(probs))
        reproduces, differs = runs[0] == runs[1], runs[0] != other
        return reproduces and differs and chi2 < 16.27, (
            f"seeded runs identical {reproduces}, another seed differs {differs}; chi-square of {draws} draws "
            f"of [0.1, 0.2, 0.3, 0.4] {chi2:.2f} (3 degrees of freedom, < 16.27 at 0.001)")

    check("engine in half precision vs float32 on the CPU", half_precision)
    if "full" in state:
        check("the reference attention on the device", reference_attention)
        check("decode steps from CUDA graphs", decode_graphs)
        check("sampling on the device", sampling)
        check("speculative decoding (prompt lookup) on the device", speculative)
        check("a float16 KV pool", kv_cache_dtype)
        check("runner owns a CUDA stream", runner_stream)
        check("memory reader", memory_reader)
        check("sharded over two stages", loading_mode("sharded", devices=(f"{device}:0",) * 2
                                                      if device == "cuda" else (device, device)))
        check("on demand (pinned host weights, side-stream prefetch)", loading_mode("on_demand"))
        check("int8", quantized("int8"))
        check("int4", quantized("int4"))
        if "int8" in state:
            check("int8 on demand", loading_mode("on_demand", against="int8", quantization="int8"))
    print(f"{failures} failed", flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main())
