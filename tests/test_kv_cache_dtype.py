"""A KV pool in float16 or bfloat16 (`kv_cache_dtype`): checked by name, sized by its element size,
written rounded to nearest even and read widened by every path (our kernels and torch's agree on
the same rounded values), and an engine over it serves as one over float32 pools does: the same
tokens with and without the fast path, through prefix hits, chunking and preemption, and close to
the float32 pool's logits; a float16 pool that overflows fails its requests, saying so."""
from __future__ import annotations

import pytest
import torch

from conftest import make_checkpoint
from engine_steps import drain
from paged_steps import random_paged_step
from shared.engine_config import ConfigError, EngineConfig
from worker.engine import Engine, SamplingParams
from worker.kv_cache import bytes_per_block, num_blocks_for_budget, resolve_kv_cache_dtype
from worker.model import cpu_kernels
from worker.model.attention import paged_attention, paged_attention_reference, write_kv
from worker.model.config import ModelConfig
from worker.model.cpu_fast_path import choose_fast_path
from worker.model.weights import load_model
from worker.scoring import window_logits

HALF_TYPES = [torch.float16, torch.bfloat16]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="our CPU kernels did not build")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("kv-dtype") / "llama", "llama")


def test_a_kv_cache_dtype_is_checked_by_name():
    for name in ("", "float32", "float16", "bfloat16"):
        assert EngineConfig(kv_cache_dtype=name).kv_cache_dtype == name
    for bad in ("fp16", "float64", "int8", "half"):
        with pytest.raises(ConfigError, match=f"kv_cache_dtype must be .*float16.*bfloat16.*got '{bad}'"):
            EngineConfig(kv_cache_dtype=bad)


def test_the_empty_name_is_the_compute_dtype():
    assert resolve_kv_cache_dtype("", torch.float32) is torch.float32
    assert resolve_kv_cache_dtype("", torch.bfloat16) is torch.bfloat16
    assert resolve_kv_cache_dtype("float16", torch.float32) is torch.float16
    assert resolve_kv_cache_dtype("float32", torch.bfloat16) is torch.float32


def test_a_half_pool_holds_twice_the_blocks_of_the_same_budget(llama):
    config = ModelConfig.from_model_dir(llama)
    budget = 3 * bytes_per_block(config, 16, torch.float32) + 100
    assert num_blocks_for_budget(config, 16, torch.float32, budget) == 3
    for dtype in HALF_TYPES:
        assert bytes_per_block(config, 16, dtype) * 2 == bytes_per_block(config, 16, torch.float32)
        assert num_blocks_for_budget(config, 16, dtype, budget) == 6
    # The engine sizes its pools so: the same kv_cache_bytes, twice the blocks, the same bytes.
    engines = {name: Engine.from_model_dir(llama, kv_cache_bytes=1 << 20, kv_cache_dtype=name)
               for name in ("", "bfloat16", "float16")}
    blocks = {name: e.block_manager.num_blocks for name, e in engines.items()}
    assert blocks["bfloat16"] == blocks["float16"] == 2 * blocks[""]
    for name, engine in engines.items():
        k_cache, v_cache = engine.kv_caches[0]
        assert k_cache.dtype == v_cache.dtype == resolve_kv_cache_dtype(name, torch.float32)
        pool_bytes = sum(k.nbytes + v.nbytes for k, v in engine.kv_caches)
        assert pool_bytes == engine.kv_pool_usage().pool_bytes <= 1 << 20
    # The profiling forward (CUDA sizing) takes the pool's type too.
    engines["bfloat16"].runner.profile_peak_memory(num_tokens=40, kv_dtype=torch.bfloat16)


def _half_step(dtype, query_lens, context_lens, num_heads, num_kv_heads, head_dim, seed=0):
    """q, this step's k and v, half pools holding the context and (written) this step's K/V, and
    the metadata; also the float32 pools the half ones were rounded from."""
    g = torch.Generator().manual_seed(seed)
    step = random_paged_step(query_lens, context_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, generator=g)
    (k32, v32), = step.kv_caches
    tokens = sum(query_lens)
    q = torch.randn(tokens, num_heads, head_dim, generator=g) * 2
    k, v = torch.randn(tokens, num_kv_heads, head_dim, generator=g), torch.randn(tokens, num_kv_heads, head_dim,
                                                                                  generator=g)
    write_kv(k32, v32, k, v, step.meta.slot_mapping)
    return q, k, v, k32.to(dtype), v32.to(dtype), step.meta, (k32, v32)


@needs_kernels
@pytest.mark.parametrize("dtype", HALF_TYPES, ids=_name)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(8, 4, 64), (14, 2, 64), (4, 4, 12)])
def test_the_decode_kernel_reads_a_half_pool_as_torch_does(dtype, num_heads, num_kv_heads, head_dim):
    """head_dim 12 takes the kernel's portable path; the others its AVX2 one."""
    kernels = cpu_kernels.load()
    lens = [1, 7, 16, 17, 100, 300]
    q, k, v, k_cache, v_cache, meta, (k32, v32) = _half_step(dtype, [1] * len(lens), [n - 1 for n in lens],
                                                             num_heads, num_kv_heads, head_dim)
    scale = head_dim ** -0.5
    ours = kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
    # Both read the same rounded values, so only float32 summation order separates them.
    torch.testing.assert_close(ours, paged_attention_reference(q, k, v, k_cache, v_cache, meta, scale),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, paged_attention(q, k, v, k_cache, v_cache, meta, scale), rtol=1e-5, atol=1e-5)
    # ... and they are the half values, not the float32 ones they were rounded from.
    unrounded = paged_attention_reference(q, k, v, k32, v32, meta, scale)
    assert (ours - unrounded).abs().max() > 1e-5
    torch.testing.assert_close(ours, unrounded, rtol=0, atol=0.05)


@needs_kernels
@pytest.mark.parametrize("dtype", HALF_TYPES, ids=_name)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(8, 4, 64), (6, 6, 80)])
def test_the_prefill_kernel_reads_a_half_pool_as_torch_does(dtype, num_heads, num_kv_heads, head_dim):
    kernels = cpu_kernels.load()
    # fresh prompts, chunks after cached context (block-aligned or not), one-token chunks, long ones
    query_lens, context_lens = [1, 5, 37, 16, 1, 130, 3], [0, 0, 0, 16, 40, 21, 300]
    q, k, v, k_cache, v_cache, meta, _ = _half_step(dtype, query_lens, context_lens, num_heads, num_kv_heads,
                                                    head_dim, seed=head_dim)
    meta.num_decodes = 0  # every sequence as a prompt chunk, the 1-token ones included
    scale = head_dim ** -0.5
    ours = torch.full_like(q, float("nan"))
    kernels.paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.prefill_query_starts,
                                    scale, ours)
    torch.testing.assert_close(ours, paged_attention_reference(q, k, v, k_cache, v_cache, meta, scale),
                               rtol=1e-5, atol=1e-5)
    # torch's batched path attends fresh chunks to their own K/V: rounded, as the pool holds them.
    torch.testing.assert_close(ours, paged_attention(q, k, v, k_cache, v_cache, meta, scale), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", HALF_TYPES, ids=_name)
def test_the_rotary_kernel_writes_k_and_v_rounded_as_torch_rounds(dtype):
    kernels = cpu_kernels.load()
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, tokens, slots = 8, 4, 64, 11, 64
    # Values from where float16 is subnormal to where it overflows, and ties to round.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * torch.logspace(-6, 5, tokens)[:, None]
    qkv[0, heads * dim:heads * dim + 4] = torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, 1 + 2 ** -8, 1 + 3 * 2 ** -8])
    angles = torch.rand(tokens, dim // 2, generator=g) * 6.3
    cos, sin = angles.cos(), angles.sin()
    cos[0, :4], sin[0, :4] = 1.0, 0.0  # the ties stay as they are
    slot_mapping = torch.randperm(slots, generator=g)[:tokens]
    shape = (slots // 16, 16, kv_heads, dim)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    kernels.rotary_and_write_kv(qkv, cos, sin, slot_mapping, k_cache, v_cache, heads)
    # qkv now holds the rotated k beside the untouched v, in float32.
    k = qkv.view(tokens, -1, dim)[:, heads:heads + kv_heads]
    v = qkv.view(tokens, -1, dim)[:, heads + kv_heads:]
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    want_k.view(-1, kv_heads, dim)[slot_mapping] = k.to(dtype)
    want_v.view(-1, kv_heads, dim)[slot_mapping] = v.to(dtype)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    # torch's write rounds the same way.
    torch_k, torch_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    write_kv(torch_k, torch_v, k, v, slot_mapping)
    assert torch.equal(torch_k, want_k) and torch.equal(torch_v, want_v)


@needs_kernels
def test_the_kernels_refuse_other_pool_types_by_name():
    kernels = cpu_kernels.load()
    q, _, _, k_cache, v_cache, meta, _ = _half_step(torch.float16, [1, 1], [4, 9], 4, 2, 16)
    for k, v in ((k_cache.double(), v_cache.double()), (k_cache, v_cache.bfloat16())):
        with pytest.raises(RuntimeError, match="paged_decode_attention: the K and V pools must both be float32, "
                                               "float16 or bfloat16"):
            kernels.paged_decode_attention(q, k, v, meta.block_tables, meta.seq_lens, 0.25)


@needs_kernels
@pytest.mark.parametrize("dtype", HALF_TYPES, ids=_name)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: per-head q/k norms before the rotary kernel
def test_the_fast_path_matches_the_modules_over_half_pools(tmp_path, dtype, arch):
    model = load_model(make_checkpoint(tmp_path / arch, arch, num_hidden_layers=3))
    cfg = model.config
    g = torch.Generator().manual_seed(2)
    query_lens, context_lens = [1, 1, 24, 7], [50, 2, 0, 31]
    step = random_paged_step(query_lens, context_lens, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                             generator=g, num_layers=cfg.num_layers)
    ids = torch.randint(3, cfg.vocab_size, (sum(query_lens),), generator=g)
    fast, _ = choose_fast_path(model, release_float_weights=False)
    results = []
    for computes in (model, fast):
        kv = [(k.to(dtype), v.to(dtype)) for k, v in step.kv_caches]
        with torch.inference_mode():
            hidden = computes.forward(ids, step.positions, kv, step.meta)
            results.append((hidden, computes.compute_logits(hidden), kv))
    (hidden, logits, kv), (want_hidden, want_logits, want_kv) = results[1], results[0]
    # K/V computed in another order may round to the neighbouring half value (checked below); a
    # later layer reading such a value moves by a fraction of that half ulp, not a float32 one.
    flipped = sum(int((k != want_k).sum() + (v != want_v).sum()) for (k, v), (want_k, want_v) in zip(kv, want_kv))
    tol = 1e-5 if flipped == 0 else 1e-4
    torch.testing.assert_close(hidden, want_hidden, atol=tol, rtol=tol)
    torch.testing.assert_close(logits, want_logits, atol=tol, rtol=tol)
    for (k, v), (want_k, want_v) in zip(kv, want_kv):
        assert k.dtype == dtype
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(k.float(), want_k.float(), atol=1e-6, rtol=eps)
        torch.testing.assert_close(v.float(), want_v.float(), atol=1e-6, rtol=eps)


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_an_engine_over_a_half_pool_gives_the_same_tokens_with_and_without_its_fast_path(llama, kv_cache_dtype):
    engine = Engine.from_model_dir(llama, num_kv_blocks=128, kv_cache_dtype=kv_cache_dtype)
    assert engine.kv_caches[0][0].dtype == resolve_kv_cache_dtype(kv_cache_dtype, torch.float32)
    prompts = _prompts(1, (1, 5, 16, 17, 48, 100))
    fast = [o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)]
    fast_path, engine.runner.fast_path = engine.runner.fast_path, None
    engine.evict_prefix_cache()
    assert [o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)] == fast
    assert fast_path is not None or cpu_kernels.load() is None


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_a_half_pool_stays_close_to_a_float32_one(llama, kv_cache_dtype):
    """Teacher-forced logits within a few roundings of the pool's type times the logits' scale
    (K/V carry a relative error of at most eps / 2 each, and attention averages it), and the
    greedy outputs start alike (whole sequences may part at a near-tie later on)."""
    prompts = _prompts(1, (1, 5, 16, 17, 31, 48, 64, 100))
    engines = {name: Engine.from_model_dir(llama, num_kv_blocks=128, kv_cache_dtype=name)
               for name in ("float32", kv_cache_dtype)}
    outs = {name: [o.token_ids for o in e.generate(prompts, GREEDY, use_tqdm=False)] for name, e in engines.items()}
    assert [o[0] for o in outs[kv_cache_dtype]] == [o[0] for o in outs["float32"]]
    whole = sum(a == b for a, b in zip(outs[kv_cache_dtype], outs["float32"]))
    assert whole >= len(prompts) // 2, outs
    # Chunks of 32: every chunk after the first reads its context back from the pool.
    sequence = prompts[-1] + outs["float32"][-1]
    logits = {name: window_logits(e.model, sequence, chunk_size=32, fast_path=e.runner.fast_path,
                                  kv_cache_dtype=name) for name, e in engines.items()}
    reference = logits["float32"]
    drift = (logits[kv_cache_dtype] - reference).abs().max().item()
    tolerance = 4 * torch.finfo(resolve_kv_cache_dtype(kv_cache_dtype, torch.float32)).eps * reference.abs().max().item()
    assert 0 < drift < tolerance


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_prefix_hits_chunking_and_preemption_over_a_half_pool_change_nothing(llama, kv_cache_dtype):
    """The pattern of test_model_vs_transformers' crowd test: the requests alone, then together on a
    pool far too small for them, in chunks of 16, four of them sharing a cached 48-token prefix."""
    shared_prefix = _prompts(3, (48,))[0]
    prompts = _prompts(4, (20, 40, 60, 80)) + [shared_prefix + tail for tail in _prompts(5, (3, 9, 17, 30))]
    solo = Engine.from_model_dir(llama, num_kv_blocks=256, kv_cache_dtype=kv_cache_dtype)
    alone = [solo.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts]
    crowd = Engine.from_model_dir(llama, num_kv_blocks=24, max_num_seqs=8, max_prefill_chunk_tokens=16,
                                  max_num_batched_tokens=64, kv_cache_dtype=kv_cache_dtype)
    crowd.generate([shared_prefix + [7]], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    for i, prompt in reversed(list(enumerate(prompts))):  # the sharers first, before pressure evicts the prefix
        crowd.add_request(f"r{i}", prompt, GREEDY)
    final = drain(crowd)
    assert [final[f"r{i}"].token_ids for i in range(len(prompts))] == alone
    assert crowd.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert [final[f"r{i}"].num_cached_tokens for i in range(4, 8)] == [48] * 4


def test_a_float16_pool_that_overflows_fails_its_requests_saying_so(tmp_path):
    """V past float16's range (65504) is inf in a float16 pool and the logits NaN: the request ends with an
    error pointing at bfloat16, never with token 0 over and over as if it were an answer."""
    from safetensors.torch import load_file, save_file
    folder = make_checkpoint(tmp_path / "large-v", "llama")
    weights = load_file(str(folder / "model.safetensors"))
    for name, tensor in weights.items():  # V x 1e6 and the output projection / 1e6: the same model
        if name.endswith(("v_proj.weight", "o_proj.weight")):
            tensor.mul_(1e6 if "v_proj" in name else 1e-6)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    prompts = _prompts(5, [9, 30])
    for kv_cache_dtype in ("", "bfloat16"):
        outputs = Engine.from_model_dir(folder, num_kv_blocks=32, kv_cache_dtype=kv_cache_dtype).generate(
            prompts, GREEDY, use_tqdm=False)
        assert all(o.finish_reason == "length" and o.token_ids.count(0) < len(o.token_ids) for o in outputs)
    for out in Engine.from_model_dir(folder, num_kv_blocks=32, kv_cache_dtype="float16").generate(
            prompts, GREEDY, use_tqdm=False):
        assert out.finish_reason == "error" and out.token_ids == [], out
        assert "logits for this request are not finite" in out.error and "kv_cache_dtype 'bfloat16'" in out.error
