"""The CPU fast path (worker/model/cpu_fast_path.py): the same hidden states, K/V writes and
logits as the plain modules, by either route (every layer in one call, or kernel by kernel),
float or weight-only quantized (INT8, INT4, mixed; with input scales and biases); chosen once,
with a reason, and declined wherever the modules must run."""
from __future__ import annotations

import pytest
import torch

from conftest import make_checkpoint
from paged_steps import random_paged_step
from shared.sampling_params import SamplingParams
from worker.model import cpu_kernels
from worker.model.attention import paged_attention_reference
from worker.model.cpu_fast_path import CpuFastPath, choose_fast_path
from worker.model.quantization import SMALL_ROWS, QuantizedLinear
from worker.model.quantize_model import quantize_model
from worker.model.weights import load_model
from shared.quantization_rule import QuantizationRule

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="our CPU kernels did not build")

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _step(model, query_lens, context_lens, seed=0):
    """Inputs for one step (decodes first) over random pools holding each sequence's context."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    step = random_paged_step(query_lens, context_lens, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                             generator=g, num_layers=cfg.num_layers)
    ids = torch.randint(3, cfg.vocab_size, (sum(query_lens),), generator=g)
    return ids, step.positions, step.kv_caches, step.meta


def _forward(computes, step):
    """Hidden states, logits of every token and the pools after one forward of `computes` (the
    model or a fast path), on copies of the step's pools."""
    ids, positions, kv, meta = step
    kv = [(k.clone(), v.clone()) for k, v in kv]
    with torch.inference_mode():
        hidden = computes.forward(ids, positions, kv, meta)
        logits = computes.compute_logits(hidden)
    return hidden, logits, kv


def _assert_same(got, want):
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # Qwen3's modules rotate q and k with torch ops, the fast path with the rotary kernel:
    # the same arithmetic, rounded in another order.
    for (k_got, v_got), (k_want, v_want) in zip(got[2], want[2]):
        torch.testing.assert_close(k_got, k_want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v_got, v_want, atol=1e-5, rtol=1e-5)


class _CountingKernels:
    """Our kernels, counting the one-call decoder_layers calls."""

    def __init__(self, kernels):
        self._kernels, self.one_calls = kernels, 0

    def decoder_layers(self, *args):
        self.one_calls += 1
        return self._kernels.decoder_layers(*args)

    def __getattr__(self, name):
        return getattr(self._kernels, name)


def _counting(fast_path: CpuFastPath) -> _CountingKernels:
    fast_path.kernels = counting = _CountingKernels(fast_path.kernels)
    for layer in fast_path.layers:  # the packed projections call the kernels too
        for projection in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if hasattr(projection, "kernels"):
                projection.kernels = counting
    return counting


# Decode-only, prompt-only and mixed steps (one-token sequences first, as the runner orders
# them; one with nothing cached), chunks after cached context.
STEPS = [
    ([1, 1, 1], [40, 17, 3]),
    ([13], [0]),
    ([1, 1, 1, 9], [33, 5, 0, 16]),
    ([1, 1, 24, 7], [50, 2, 0, 31]),
]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # qwen2: biases on q/k/v; qwen3: per-head q/k norms
@pytest.mark.parametrize("query_lens, context_lens", STEPS)
@pytest.mark.parametrize("route", ["one call", "layer by layer"])
def test_the_fast_path_matches_the_modules(tmp_path, arch, query_lens, context_lens, route):
    model = load_model(make_checkpoint(tmp_path / arch, arch, num_hidden_layers=3, mlp_bias=False))
    step = _step(model, query_lens, context_lens)
    want = _forward(model, step)
    fast, _ = choose_fast_path(model, release_float_weights=False)
    assert fast.one_call_tensors is not None
    if route == "layer by layer":  # the route a quantized model takes
        fast = CpuFastPath(model, cpu_kernels.load(), release_float_weights=False, one_call=False)
    counting = _counting(fast)
    _assert_same(_forward(fast, step), want)
    assert counting.one_calls == (route == "one call")


def test_the_fast_path_with_released_weights_and_biases_everywhere(tmp_path):
    """Only the panels kept (as the engine serves), and a bias on every projection: the fast
    path and the modules, which now read their weights back from the panels, agree."""
    model = load_model(make_checkpoint(tmp_path / "llama", "llama", attention_bias=True, mlp_bias=True))
    assert model.layers[0].mlp.down_proj.bias is not None and model.layers[0].self_attn.o_proj.bias is not None
    step = _step(model, [1, 1, 11], [21, 4, 6])
    want = _forward(model, step)
    weights_before = {name: t.clone() for name, t in model.state_dict().items()}
    fast, _ = choose_fast_path(model)
    held = dict(model.named_buffers())
    assert "layers.0.self_attn.qkv_proj.weight_panels" in held and "lm_head.weight_panels" in held
    assert "layers.0.self_attn.qkv_proj.weight" not in dict(model.named_parameters())
    # One copy: the module holds the very panels the fast path computes with.
    assert held["layers.0.mlp.down_proj.weight_panels"] is fast.layers[0].down.panels
    assert all(torch.equal(weights_before[name], t) for name, t in model.state_dict().items())
    _assert_same(_forward(fast, step), want)
    _assert_same(_forward(model, step), want)


def test_a_tied_head_keeps_the_embedding_weight(tmp_path):
    model = load_model(make_checkpoint(tmp_path / "qwen3", "qwen3"))
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.embed_tokens.weight
    step = _step(model, [1, 4], [9, 0])
    want = _forward(model, step)
    fast, _ = choose_fast_path(model)
    assert model.lm_head.weight is model.embed_tokens.weight  # the lookup's float weight stays
    _assert_same(_forward(fast, step), want)


def test_a_head_dim_the_prefill_kernel_does_not_take(tmp_path):
    """head_dim 12: a step with a prompt chunk runs layer by layer (prompt chunks through SDPA);
    a decode-only step of the same model still takes the one call (the decode kernel takes any
    head_dim). Both match the modules."""
    odd = load_model(make_checkpoint(tmp_path / "odd", "llama", hidden_size=48, num_attention_heads=4))
    assert odd.config.head_dim == 12
    fast, reason = choose_fast_path(odd, release_float_weights=False)
    assert not fast.prefill_kernel and "SDPA" in reason
    counting = _counting(fast)
    for query_lens, context_lens, one_call in (([1, 5], [9, 0], False), ([1, 1], [9, 3], True)):
        step = _step(odd, query_lens, context_lens)
        before = counting.one_calls
        _assert_same(_forward(fast, step), _forward(odd, step))
        assert counting.one_calls - before == int(one_call)


def test_the_head_norm_kernel_matches_rms_norm_per_head():
    kernels = cpu_kernels.load()
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, tokens = 6, 2, 16, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 3
    q_w, k_w = torch.randn(dim, generator=g), torch.randn(dim, generator=g)
    want = qkv.clone().view(tokens, -1, dim)
    want[:, :heads] = torch.nn.functional.rms_norm(want[:, :heads], (dim,), q_w, 1e-6)
    want[:, heads:heads + kv_heads] = torch.nn.functional.rms_norm(want[:, heads:heads + kv_heads], (dim,), k_w, 1e-6)
    kernels.head_rms_norm(qkv, q_w, k_w, heads, kv_heads, 1e-6)
    torch.testing.assert_close(qkv.view(tokens, -1, dim), want, atol=1e-5, rtol=1e-5)


def test_forward_hooks_observe_the_modules_which_the_runner_runs_without_a_fast_path(tmp_path):
    """Calibration records activations through forward hooks: they fire when the modules run
    (the model itself, a runner without a fast path), never through the fast path."""
    from worker.engine import Engine
    engine = Engine.from_model_dir(make_checkpoint(tmp_path / "llama", "llama"), num_kv_blocks=32)
    seen = []
    engine.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    engine.runner.fast_path = None
    engine.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert seen == [6, 1, 1]  # the prompt, then two decodes (the last token is sampled, not run)
    engine.runner.fast_path, _ = choose_fast_path(engine.model, engine.runner.attention_fn)
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert seen == [6, 1, 1]


def _quantized(folder, rule: str, small_path: str = "ours", path: str = "dequant", input_scales: bool = False):
    model = load_model(folder)
    scales = None
    if input_scales:  # as calibration gives them: one positive factor per input feature
        g = torch.Generator().manual_seed(11)
        scales = {name: torch.rand(m.in_features, generator=g) + 0.5 for name, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and name != "lm_head"}
    quantize_model(model, QuantizationRule.parse(rule), measure_paths=False, input_scales=scales)
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            m.small_path, m.path = small_path, path
    return model


@pytest.mark.parametrize("rule", ["*:int8", "*:int4", "attention:int8,mlp:int4"])
@pytest.mark.parametrize("input_scales", [False, True])
def test_quantized_layers_take_the_one_call_on_small_steps(tmp_path, rule, input_scales):
    """Our INT8 / INT4 kernels inside the one call: the same hidden states, logits and K/V as the
    layer-by-layer route through the modules, on steps of up to SMALL_ROWS tokens; larger steps,
    whose quantized path is another one, go layer by layer."""
    folder = make_checkpoint(tmp_path / "llama", "llama", num_hidden_layers=3, attention_bias=True, mlp_bias=True,
                             hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    model = _quantized(folder, rule, input_scales=input_scales)
    fast, reason = choose_fast_path(model, release_float_weights=False)
    assert fast.one_call_tensors is not None and fast.one_call_tensors_large is None, reason
    assert f"up to {SMALL_ROWS} tokens" in reason
    by_layers = CpuFastPath(model, cpu_kernels.load(), release_float_weights=False, one_call=False)
    counting = _counting(fast)
    for query_lens, context_lens, one_call in (([1, 1, 1], [40, 17, 3], True), ([1, 1, 9], [5, 0, 16], True),
                                                ([1, 40], [3, 0], False)):
        step = _step(model, query_lens, context_lens)
        before = counting.one_calls
        _assert_same(_forward(fast, step), _forward(by_layers, step))
        assert counting.one_calls - before == int(one_call), (query_lens, one_call)
    torch.testing.assert_close(_forward(fast, step)[1], _forward(model, step)[1], atol=1e-4, rtol=1e-4)


def test_quantized_layers_whose_paths_are_all_ours_take_the_one_call_at_every_size(tmp_path):
    model = _quantized(make_checkpoint(tmp_path / "llama", "llama", num_hidden_layers=2), "*:int8", path="ours")
    fast, reason = choose_fast_path(model, release_float_weights=False)
    assert fast.one_call_tensors_large is not None and reason.endswith("every decoder layer in one call")
    step = _step(model, [1, 40], [3, 0])
    _assert_same(_forward(fast, step), _forward(model, step))


def test_a_quantized_layer_on_another_path_keeps_every_step_layer_by_layer(tmp_path):
    model = _quantized(make_checkpoint(tmp_path / "llama", "llama", num_hidden_layers=2), "*:int8")
    model.layers[1].mlp.down_proj.small_path = "dequant"  # its plan measured torch's faster
    fast, reason = choose_fast_path(model, release_float_weights=False)
    assert fast.one_call_tensors is None and fast.one_call_tensors_large is None and "layer by layer" in reason
    step = _step(model, [1, 1], [7, 2])
    _assert_same(_forward(fast, step), _forward(model, step))


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_an_engine_gives_the_same_tokens_with_and_without_its_fast_path(tmp_path, quantization):
    """With the quantization paths its plan measured, whichever route that makes."""
    from worker.engine import Engine
    engine = Engine.from_model_dir(make_checkpoint(tmp_path / "llama", "llama"), num_kv_blocks=64,
                                   quantization=quantization, quantization_calibration="none")
    prompts = [list(range(3, 30)), [9] * 12, [40, 41]]
    engine.runner.fast_path = None
    modules = [o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)]
    fast, reason = choose_fast_path(engine.model, engine.runner.attention_fn)
    small_ours = all(m.small_path == "ours" for name, m in engine.model.named_modules()
                     if isinstance(m, QuantizedLinear) and name.startswith("layers."))
    assert (fast.one_call_tensors is not None) == (quantization == "none" or small_ours), reason
    engine.runner.fast_path = fast
    engine.evict_prefix_cache()
    assert [o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)] == modules


def test_the_fast_path_is_declined_where_the_modules_must_run(tmp_path, monkeypatch):
    from worker.model.placement import attach_placement, plan_weights
    folder = make_checkpoint(tmp_path / "llama", "llama")
    model = load_model(folder)
    fast, reason = choose_fast_path(model, paged_attention_reference)
    assert fast is None and "paged_attention_reference" in reason
    assert choose_fast_path(load_model(folder, dtype="float64"))[0] is None  # computes in float64
    attach_placement(model, plan_weights("sharded", "cpu", ("cpu", "cpu"), model.config.num_layers))
    fast, reason = choose_fast_path(model)
    assert fast is None and "placement" in reason
    assert "weight" in dict(model.layers[0].self_attn.qkv_proj.named_parameters())  # nothing released
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    fast, reason = choose_fast_path(load_model(folder))
    assert fast is None and "not built" in reason
