"""bfloat16 and float16 weights on the CPU: stored in the checkpoint's half type, widened to float32
where they are read, every activation, the logits and the KV cache in float32. Checked against
transformers on the same half checkpoint upcast to float32, and the fast path against the modules."""
from __future__ import annotations

import pytest
import torch
import transformers

from conftest import ARCHITECTURES, make_checkpoint
from worker.engine import Engine, SamplingParams
from worker.model import cpu_kernels
from worker.model.attention import AttentionMetadata
from worker.model.cpu_fast_path import CpuFastPath, PackedLinear, choose_fast_path
from worker.model.layers import Linear, pack_panels
from worker.model.quantization import QuantizedLinear
from worker.model.weights import load_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
HALF_TYPES = ["bfloat16", "float16"]

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="our CPU kernels did not build")


def _half_checkpoint(path, half: str, arch: str = "llama", **overrides):
    """A tiny checkpoint saved in bfloat16 or float16, as real releases are."""
    folder = make_checkpoint(path / "float", arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, half))
    model.save_pretrained(path / arch)
    return path / arch


@pytest.mark.parametrize("half", HALF_TYPES)
def test_half_panels_compute_what_float32_panels_of_the_same_values_do(half):
    """The bf16 / fp16 kernel widens exactly and accumulates in the same order: bit for bit the float32
    kernel's result on the widened weight, at every row tile size and a ragged last panel, whether
    the panel is widened in registers per row tile or, with AVX2 above 18 rows, once into a float32
    copy, and whether a one-row tile takes one panel or (AVX2) four: 3 panels, 5 (four, then a
    ragged one) and 4 (the ragged one the last of four)."""
    kernels = cpu_kernels.load()
    g = torch.Generator().manual_seed(3)
    for out_features in (37, 69, 55):
        for rows in (1, 2, 5, 6, 7, 13, 18, 19, 40, 100):
            weight = torch.randn(out_features, 96, generator=g).to(getattr(torch, half))
            x = torch.randn(rows, 96, generator=g)
            got, want = torch.empty(rows, out_features), torch.empty(rows, out_features)
            kernels.linear_packed(x, pack_panels(weight), got)
            kernels.linear_packed(x, pack_panels(weight.float()), want)
            assert torch.equal(got, want), (out_features, rows)
            torch.testing.assert_close(got, x @ weight.float().t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("half", HALF_TYPES)
def test_the_weights_are_held_in_half_and_everything_else_in_float32(tmp_path, half):
    dtype = getattr(torch, half)
    folder = _half_checkpoint(tmp_path, half, "qwen2")  # biases on q, k and v
    model = load_model(folder, dtype=half)
    assert model.compute_dtype == torch.float32 and model.embed_tokens.weight.dtype == dtype
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            assert module.weight.dtype == dtype, name
            assert module.bias is None or module.bias.dtype == torch.float32, name
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "norm" in n)
    float_model = load_model(folder, dtype="float32")
    half_bytes = sum(m.weight.nbytes for m in model.modules() if isinstance(m, Linear))
    assert 2 * half_bytes == sum(m.weight.nbytes for m in float_model.modules() if isinstance(m, Linear))
    fast, reason = choose_fast_path(model)
    assert fast is not None and fast.one_call_tensors_large is not None, reason
    assert all(layer.qkv.panels.dtype == dtype for layer in fast.layers)
    assert isinstance(fast.head, PackedLinear) and fast.head.panels.dtype == dtype
    # The fast path holds the only copy: released modules read their weight back from its panels.
    assert model.layers[0].mlp.down_proj.weight.dtype == dtype


@pytest.mark.parametrize("half", HALF_TYPES)
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("route", ["modules", "fast path"])
def test_prompt_logits_match_transformers_on_the_upcast_checkpoint(tmp_path, arch, route, half):
    """Against transformers running the half checkpoint upcast to float32: the same float32
    arithmetic on the same weight values, so the tolerance is float32 summation order's (as the
    float32 parity tests), not half rounding's; a half activation anywhere would miss it by far."""
    folder = _half_checkpoint(tmp_path, half, arch)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, half)).float().eval()
    model = load_model(folder, dtype=half)
    computes = model if route == "modules" else choose_fast_path(model, release_float_weights=False)[0]
    ids = torch.randint(3, 256, (45,), generator=torch.Generator().manual_seed(2))
    config = model.config
    shape = (8, 16, config.num_kv_heads, config.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_layers)]
    meta = AttentionMetadata.build([[5, 2, 7]], [0], [len(ids)], 16)
    with torch.inference_mode():
        expected = reference(ids[None]).logits[0]
        hidden = computes.forward(ids, torch.arange(len(ids)), kv, meta)
        logits = computes.compute_logits(hidden)
    assert logits.dtype == torch.float32 and kv[0][0].dtype == torch.float32
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("half", HALF_TYPES)
def test_a_half_checkpoint_is_served_in_its_half_type_on_the_cpu_unless_asked_otherwise(tmp_path, half):
    folder = _half_checkpoint(tmp_path, half)
    assert load_model(folder).embed_tokens.weight.dtype == getattr(torch, half)
    assert load_model(folder, dtype="float32").embed_tokens.weight.dtype == torch.float32
    float_folder = tmp_path / "float"  # the float32 checkpoint it was saved from
    assert load_model(float_folder).embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("half", HALF_TYPES)
def test_an_engine_serves_half_weights_with_the_same_tokens_on_either_route(tmp_path, half):
    folder = _half_checkpoint(tmp_path, half)
    engine = Engine.from_model_dir(folder, num_kv_blocks=64, device="cpu")  # the checkpoint's half type
    assert engine.runner.fast_path is not None and engine.kv_caches[0][0].dtype == torch.float32
    prompts = [list(range(3, 40)), [9] * 12, [40, 41]]
    fast = [o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)]
    fast_path, engine.runner.fast_path = engine.runner.fast_path, None
    engine.evict_prefix_cache()
    assert [o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)] == fast
    # The float32 engine on the same (half-valued) checkpoint computes the same function.
    float_engine = Engine.from_model_dir(folder, dtype="float32", num_kv_blocks=64, device="cpu")
    assert [o.token_ids for o in float_engine.generate(prompts, GREEDY, use_tqdm=False)] == fast
    assert isinstance(fast_path, CpuFastPath)


@pytest.mark.parametrize("half", HALF_TYPES)
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_half_weights_quantize_to_float32_scaled_layers_that_take_the_one_call(tmp_path, quantization, half):
    folder = _half_checkpoint(tmp_path, half, hidden_size=128, intermediate_size=256)
    engine = Engine.from_model_dir(folder, dtype=half, quantization=quantization, device="cpu",
                                   quantization_calibration="none", num_kv_blocks=64)
    quantized = [m for m in engine.model.modules() if isinstance(m, QuantizedLinear)]
    assert quantized and all(m.scales.dtype == torch.float32 and m.small_path == "ours" for m in quantized)
    assert engine.runner.fast_path.one_call_tensors is not None
    float_engine = Engine.from_model_dir(folder, dtype="float32", quantization=quantization, device="cpu",
                                         quantization_calibration="none", num_kv_blocks=64)
    prompts = [list(range(3, 30)), [7, 8, 9]]
    assert ([o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)]
            == [o.token_ids for o in float_engine.generate(prompts, GREEDY, use_tqdm=False)])
