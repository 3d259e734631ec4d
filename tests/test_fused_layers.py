"""The one-call CPU path through the decoder layers (worker/model/fused_layers.py): the same
hidden states and the same K/V writes as the modules, and the modules wherever it must not run."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import make_checkpoint
from worker.model import cpu_kernels, fused_layers, transformer
from worker.model.attention import AttentionMetadata
from worker.model.weights import load_model

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="our CPU kernels did not build")

BLOCK_SIZE = 16


def _step(model, query_lens, context_lens, seed=0):
    """Inputs for one step (decodes first) over random pools holding each sequence's context,
    with block tables scattered over the pool."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    lens = [q + c for q, c in zip(query_lens, context_lens)]
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in lens) + 3
    shape = (num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    kv = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(cfg.num_layers)]
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, positions = [], [], []
    for q_len, ctx, n in zip(query_lens, context_lens, lens):
        count = -(-n // BLOCK_SIZE)
        table, free = free[:count], free[count:]
        tables.append(table)
        for pos in range(ctx, ctx + q_len):
            positions.append(pos)
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    width = max(map(len, tables))
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=torch.tensor([t + [0] * (width - len(t))
                                                                                           for t in tables]),
                             seq_lens=torch.tensor(lens), query_lens=list(query_lens), context_lens=list(context_lens),
                             num_decodes=sum(1 for q in query_lens if q == 1))
    ids = torch.randint(3, cfg.vocab_size, (sum(query_lens),), generator=g)
    return ids, torch.tensor(positions), kv, meta


def _copy(kv):
    return [(k.clone(), v.clone()) for k, v in kv]


def _forward(model, step, fused: bool, monkeypatch):
    """Hidden states and pools after one forward, with the one-call path allowed or not;
    fails if the path taken is not the one asked for."""
    ids, positions, kv, meta = step
    kv = _copy(kv)
    calls = []
    real = fused_layers.run_fused_layers

    def spy(*args):
        out = real(*args) if fused else None
        calls.append(out is not None)
        return out

    with monkeypatch.context() as m:
        m.setattr(transformer, "run_fused_layers", spy)
        with torch.inference_mode():
            hidden = model(ids, positions, kv, meta)
    assert calls == [fused]
    return hidden, kv


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
def test_fused_layers_match_the_modules(tmp_path, monkeypatch, arch, query_lens, context_lens):
    model = load_model(make_checkpoint(tmp_path / arch, arch, num_hidden_layers=3, mlp_bias=False))
    step = _step(model, query_lens, context_lens)
    want, want_kv = _forward(model, step, fused=False, monkeypatch=monkeypatch)
    got, got_kv = _forward(model, step, fused=True, monkeypatch=monkeypatch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Qwen3's modules rotate q and k with torch ops, the one-call path with the rotary kernel:
    # the same arithmetic, rounded in another order.
    for (k_got, v_got), (k_want, v_want) in zip(got_kv, want_kv):
        torch.testing.assert_close(k_got, k_want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v_got, v_want, atol=1e-5, rtol=1e-5)


def test_fused_layers_with_released_weights_and_biases_everywhere(tmp_path, monkeypatch):
    """Only the panels kept (as the engine serves), and a bias on every projection."""
    from worker.model.layers import release_float_weights
    model = load_model(make_checkpoint(tmp_path / "llama", "llama", attention_bias=True, mlp_bias=True))
    assert model.layers[0].mlp.down_proj.bias is not None and model.layers[0].self_attn.o_proj.bias is not None
    step = _step(model, [1, 1, 11], [21, 4, 6])
    want, _ = _forward(model, step, fused=False, monkeypatch=monkeypatch)
    assert release_float_weights(model.layers) > 0
    got, _ = _forward(model, step, fused=True, monkeypatch=monkeypatch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_prompt_head_dim_the_prefill_kernel_does_not_take_runs_the_modules(tmp_path):
    """head_dim 12: a step with a prompt chunk runs the modules; a decode-only step of the same
    model still takes the one-call path (the decode kernel takes any head_dim)."""
    odd = load_model(make_checkpoint(tmp_path / "odd", "llama", hidden_size=48, num_attention_heads=4))
    assert odd.config.head_dim == 12
    for query_lens, context_lens, runs in (([1, 5], [9, 0], False), ([1, 1], [9, 3], True)):
        ids, positions, kv, meta = _step(odd, query_lens, context_lens)
        with torch.inference_mode():
            out = fused_layers.run_fused_layers(odd.layers, odd.embed_tokens(ids), odd.rotary(positions), kv, meta)
        assert (out is not None) == runs


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


def test_a_forward_hook_keeps_the_modules_and_fires(tmp_path, monkeypatch):
    model = load_model(make_checkpoint(tmp_path / "llama", "llama"))
    step = _step(model, [1, 6], [12, 0])
    seen = []
    handle = model.layers[1].mlp.down_proj.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    try:
        _forward(model, step, fused=False, monkeypatch=monkeypatch)  # asserts the fused path declined
        ids, positions, kv, meta = step
        assert fused_layers.run_fused_layers(model.layers, model.embed_tokens(ids), model.rotary(positions), kv,
                                             meta) is None
    finally:
        handle.remove()
    assert seen == [(7, model.config.intermediate_size)]


def test_quantized_layers_run_the_modules(tmp_path):
    from worker.engine import Engine
    engine = Engine.from_model_dir(make_checkpoint(tmp_path / "llama", "llama"), num_kv_blocks=16,
                                   quantization="int8")
    assert fused_layers.layer_tensors(engine.model.layers[0]) is None
