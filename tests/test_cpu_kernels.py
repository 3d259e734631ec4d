"""Our CPU kernels against torch: every matmul form `linear` and the fast path's packed linear
may take gives F.linear's result whatever the row count, and each fused kernel matches the ops
it replaces."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged_steps import random_paged_step
from worker.model import cpu_kernels
from worker.model.cpu_fast_path import PackedLinear
from worker.model.layers import (PANEL, TRANSPOSED_ROWS, WIDE_WEIGHT_RATIO, WIDE_WEIGHT_TRANSPOSED_MAX_ROWS, Linear,
                                 linear, pack_panels, unpack_panels)

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C++ compiler: the CPU kernels cannot be "
                                                                     "built here")

ROWS = [1, 2, 5, 6, 7, 13, 17, 40, WIDE_WEIGHT_TRANSPOSED_MAX_ROWS + 1, TRANSPOSED_ROWS.stop, 300]
# ordinary; wide; features not a multiple of the panel, odd in_features
SHAPES = [(96, 64), (64 * WIDE_WEIGHT_RATIO, 64), (10, 20), (3 * PANEL + 5, 33)]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_out", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_linear_matches_torch(rows, shape, with_bias, with_out, packed):
    # Every tile height of the packed kernel (rows mod 6) and each BLAS form.
    if packed and cpu_kernels.load() is None:
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here")
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(shape, generator=g)
    bias = torch.randn(shape[0], generator=g) if with_bias else None
    x = torch.randn(rows, shape[1], generator=g)
    out = torch.full((rows, shape[0]), float("nan")) if with_out else None
    if packed:
        got = PackedLinear(cpu_kernels.load(), pack_panels(weight), bias, shape[0])(x, out)
    else:
        got = linear(x, weight, bias, out=out)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    if with_out:
        assert got.data_ptr() == out.data_ptr()


def test_pack_panels_layout():
    weight = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    packed = pack_panels(weight)
    assert packed.shape == (2, 3, PANEL)
    assert packed[1, 2, 3].item() == weight[PANEL + 3, 2].item()
    assert torch.all(packed[1, :, 4:] == 0)  # the padding past 20 features


def test_pack_panels_in_groups_interleaves_each_group_by_input_feature():
    """Grouped, feature k of a group's panels is one contiguous row (panel after panel), the last
    group is padded with zero panels, and unpacking gives back the row-major weight."""
    weight = torch.arange(50 * 3, dtype=torch.float32).view(50, 3)  # 4 panels (the last 2 wide)
    plain, grouped = pack_panels(weight), pack_panels(weight, group=3)
    assert grouped.shape == (2, 3, 3, PANEL)
    for p in range(4):
        assert torch.equal(grouped[p // 3, :, p % 3], plain[p])
    assert torch.all(grouped[1, :, 1:] == 0) and torch.all(grouped[1, :, 0, 2:] == 0)
    assert torch.equal(grouped[1, 2, 0, 1], weight[49, 2])
    for group in (1, 2, 3, 4, 5):
        assert torch.equal(unpack_panels(pack_panels(weight, group), 50), weight)


def test_linear_module_computes_from_its_weight_as_it_is_now():
    torch.manual_seed(0)
    layer = Linear(32, 40, bias=True)
    x = torch.randn(3, 32)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # in place
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    layer.weight = torch.nn.Parameter(torch.randn(40, 32))  # new storage
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    # Panels for the fast path are packed from the weight as it is when asked, and never saved.
    assert torch.equal(layer.panels(), pack_panels(layer.weight))
    assert set(layer.state_dict()) == {"weight", "bias"}


def test_cpu_kernels_are_built_here():
    # This machine (and CI) has a compiler: the fast paths must really be exercised.
    assert cpu_kernels.load() is not None


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=needs_kernels)])
@pytest.mark.parametrize("shape", [(1, 64), (37, 64), (3, 5, 16)])  # decode, prefill, per-head (Qwen3 q/k norm)
def test_rms_norm_kernel_matches_the_formula(shape, kernel):
    from worker.model.layers import RMSNorm
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(shape[-1], eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g))
    x = torch.randn(shape, generator=g) * 3
    expected = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))

    def run(x):
        if not kernel:
            return norm(x)
        x = x.contiguous()
        out = torch.empty_like(x)
        cpu_kernels.load().rms_norm(x, norm.weight, 1e-5, out)
        return out
    torch.testing.assert_close(run(x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(run(x.transpose(0, -2)), expected.transpose(0, -2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels_on", [pytest.param(True, marks=needs_kernels), False])
def test_add_then_norm_updates_the_residual_and_norms_the_sum(kernels_on):
    from worker.model.layers import RMSNorm
    g = torch.Generator().manual_seed(2)
    norm = RMSNorm(72, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(72, generator=g))
    x, delta = torch.randn(37, 72, generator=g), torch.randn(37, 72, generator=g)
    total = x + delta
    expected = norm.weight * (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6))
    before = delta.clone()
    if kernels_on:
        normed = torch.empty_like(x)
        cpu_kernels.load().add_rms_norm(x, delta, norm.weight, 1e-6, normed)
    else:
        normed = norm.add_then_norm(x, delta)
    torch.testing.assert_close(x, total)  # the residual stream, updated in place
    torch.testing.assert_close(normed, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(delta, before)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 40])
def test_gated_mlp_kernel_matches_torch(rows):
    # The fast path's MLP (packed gate_up, the silu-and-mul kernel, packed down) against the module.
    from worker.model.layers import GatedMLP
    torch.manual_seed(rows)
    kernels = cpu_kernels.load()
    mlp = GatedMLP(32, 48, bias=False)
    x = torch.randn(rows, 32)
    gate_up = PackedLinear(kernels, mlp.gate_up_proj.panels(), None, 96)(x)
    hidden = torch.empty(rows, 48)
    kernels.silu_and_mul(gate_up, hidden)
    got = PackedLinear(kernels, mlp.down_proj.panels(), None, 32)(hidden)
    gate, up = F.linear(x, mlp.gate_up_proj.weight).split(48, dim=-1)
    torch.testing.assert_close(mlp(x), F.linear(F.silu(gate) * up, mlp.down_proj.weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, mlp(x), rtol=1e-5, atol=1e-5)


def test_silu_and_mul_kernel_matches_torch_over_the_whole_range():
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here")
    # 37 columns: vector lanes and the scalar tail; values from where exp underflows to overflow.
    gate = torch.cat([torch.linspace(-120, 120, 37 * 5).view(5, 37), torch.randn(3, 37) * 4])
    up = torch.randn_like(gate)
    out = torch.empty_like(gate)
    kernels.silu_and_mul(torch.cat([gate, up], dim=1), out)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=2e-6, atol=1e-30)


def _paged_step(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size=16, seed=0):
    """Random pools, scattered block tables and q for one step (decodes first), K/V already written."""
    g = torch.Generator().manual_seed(seed)
    step = random_paged_step(query_lens, context_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, generator=g,
                             block_size=block_size)
    (k_cache, v_cache), = step.kv_caches
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g) * 2
    return q, k_cache, v_cache, step.meta


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [
    (8, 4, 64),  # bench-small
    (14, 2, 64),  # heads not a multiple of the vector width (Qwen2-0.5B)
    (32, 8, 128),  # Llama 3 8B
    (6, 6, 80),  # head_dim not a multiple of 64: P V's last chunk of 16 dims
    (7, 1, 96),  # one KV head for 7 query heads; a last chunk of 32 dims
    (4, 4, 12),  # head_dim not a multiple of 8: the portable path
])
@pytest.mark.parametrize("lens, threads, block_size", [
    ([1, 7, 16, 17, 100, 300], 2, 16),  # a task per sequence
    ([300], 2, 16),  # fewer sequences than threads: each split over ranges of KV heads
    ([300], 3, 16),  # uneven ranges: 4 KV heads as 1 + 1 + 2, 8 as 2 + 3 + 3
    ([3, 8, 9, 41], 2, 5),  # blocks smaller than the eight keys scored at a time
    ([41], 3, 5),  # both: KV heads split between threads over blocks of 5
])
def test_decode_attention_kernel_matches_the_reference(num_heads, num_kv_heads, head_dim, lens, threads,
                                                       block_size):
    from worker.model.attention import paged_attention_reference
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here")
    q, k_cache, v_cache, meta = _paged_step([1] * len(lens), [n - 1 for n in lens], num_heads, num_kv_heads,
                                            head_dim, block_size=block_size, seed=num_heads * head_dim)
    scale = head_dim ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours = kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
    finally:
        torch.set_num_threads(before)
    expected = paged_attention_reference(q, None, None, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(8, 4, 64), (14, 2, 64), (32, 8, 128), (6, 6, 80)])
@pytest.mark.parametrize("query_lens, context_lens, threads", [
    # fresh prompts, chunks after cached context (block-aligned or not), one-token chunks, long ones:
    # (sequence, KV head) groups far from even, so every thread packs, then takes tiles
    ([1, 5, 37, 16, 1, 130, 3], [0, 0, 0, 16, 40, 21, 300], 2),
    ([37], [100], 2),  # one chunk: its KV heads share out evenly, a thread packs each and attends its tiles
    ([9], [300], 3),  # a verify chunk over 3 threads: by group for 6 KV heads, else packed by all, then tiles
    ([2], [3], 2),  # a short chunk: under the threshold on one thread (8 and 6 query heads)
])
@pytest.mark.parametrize("block_size", [16, 5])  # 5: a panel's 16 keys and a transpose's 8 span blocks
def test_prefill_attention_kernel_matches_the_reference(num_heads, num_kv_heads, head_dim, query_lens, context_lens,
                                                        threads, block_size):
    from worker.model.attention import paged_attention_reference
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here")
    assert kernels.prefill_attention_supported(head_dim) and not kernels.prefill_attention_supported(24)
    q, k_cache, v_cache, meta = _paged_step(query_lens, context_lens, num_heads, num_kv_heads, head_dim,
                                            block_size=block_size, seed=head_dim)
    meta.num_decodes = 0  # every sequence as a prompt chunk, the 1-token ones included
    scale = head_dim ** -0.5
    starts = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist())
    wide = torch.randn(q.shape[0], num_heads + 3, head_dim)  # q as a strided view, as inside qkv
    wide[:, :num_heads] = q
    ours = torch.full_like(q, float("nan"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernels.paged_prefill_attention(wide[:, :num_heads], k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                        starts, scale, ours)
    finally:
        torch.set_num_threads(before)
    expected = paged_attention_reference(q, None, None, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab", [1, 7, 8, 37, 32000])
def test_argmax_kernel_matches_torch_including_ties(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    logits[1] = 0.5  # all tied: the first index wins, as in torch
    if vocab > 20:
        logits[2, 3] = logits[2, 19] = 100.0  # a tie between lanes of different vectors
        logits[3, -1] = 100.0  # the maximum in the scalar tail
    got = cpu_kernels.load().argmax_rows(logits)
    assert got.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_row_of_x_gets_the_same_bits_alone_as_in_any_batch(dtype):
    """Batch invariance of the packed-panel linear: every tile shape (one row over four panels on
    AVX2, two for 2-3 rows, one or two for more; on AVX2 whole 6-row tiles over a pair of panels and
    the rest over both or each, the widened copy of many rows) sums each output in the same order, so
    a row's result does not depend on the rows beside it. 3 panels, 5 (four, then a ragged one) and 4
    (the ragged one the last of four)."""
    kernels = cpu_kernels.load()
    g = torch.Generator().manual_seed(5)
    for out_features in (37, 69, 55):
        weight = torch.randn(out_features, 80, generator=g).to(dtype)
        panels = pack_panels(weight)
        x = torch.randn(40, 80, generator=g)
        alone = torch.empty(40, out_features)
        for i in range(40):
            kernels.linear_packed(x[i:i + 1], panels, alone[i:i + 1])
        for rows in (2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 19, 40):
            batched = torch.empty(rows, out_features)
            kernels.linear_packed(x[:rows], panels, batched)
            assert torch.equal(batched, alone[:rows]), (out_features, rows)


def test_a_call_of_no_rows_writes_nothing_and_returns():
    """An empty batch through every panel route (float32, bfloat16, float16, INT8 held as panels): no tile to
    split the rows into, so nothing runs (it once divided by the zero tiles)."""
    kernels = cpu_kernels.load()
    weight = torch.randn(40, 16)
    for panels in (pack_panels(weight), pack_panels(weight.to(torch.bfloat16)), pack_panels(weight.half())):
        out = torch.empty(0, 40)
        kernels.linear_packed(torch.empty(0, 16), panels, out)
        assert out.shape == (0, 40)
    qweight = torch.randint(-127, 128, (40, 16), dtype=torch.int8)
    kernels.linear_small_batch_int8(torch.empty(0, 16), pack_panels(qweight), torch.rand(40), torch.empty(0, 40))


def test_finite_choices_keeps_each_rows_token_unless_its_logit_is_not_finite():
    """The sampler's one-call check: equal to the torch ops it replaces (gather, isfinite, masked fill),
    on strided rows and tokens; a token outside the vocabulary is refused, not read."""
    from worker.non_finite_logits import non_finite_to_zero

    kernels = cpu_kernels.load()
    wide = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    logits = wide[:, :33]  # rows 40 floats apart
    logits[1, 4] = float("nan")
    logits[2, 5] = float("inf")
    logits[3, 6] = float("-inf")
    logits[4, 7] = float("nan")  # not the row's token: the row keeps it
    tokens = torch.tensor([[9, 0], [4, 0], [5, 0], [6, 0], [8, 0], [32, 0]])[:, 0]  # a strided column
    got = kernels.finite_choices(logits, tokens)
    assert got == [9, 0, 0, 0, 8, 32]
    assert got == non_finite_to_zero(logits.clone(), tokens.clone()).tolist()
    with pytest.raises(RuntimeError, match="outside"):
        kernels.finite_choices(logits, torch.tensor([0, 0, 0, 0, 0, 33]))


def test_linear_module_repacks_when_its_data_is_swapped():
    torch.manual_seed(1)
    layer = Linear(16, 24, bias=False)
    x = torch.randn(2, 16)
    layer(x)
    layer.weight.data = torch.randn(24, 16)  # what pinning host memory does (placement.py)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


def test_released_linear_keeps_only_panels_and_still_computes_and_reads():
    torch.manual_seed(2)
    layer = Linear(24, 3 * PANEL + 5, bias=True)
    reference = layer.weight.detach().clone()
    x = torch.randn(4, 24)
    expected = F.linear(x, reference, layer.bias)
    assert layer.release_float_weight()
    assert "weight" not in dict(layer.named_parameters()) and "weight_panels" in dict(layer.named_buffers())
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.weight, reference)  # rebuilt from the panels for readers (quantization)
    assert torch.equal(unpack_panels(pack_panels(reference), reference.shape[0]), reference)
    assert torch.equal(layer.state_dict()["weight"], reference)  # checkpoints keep the [N, K] layout
    assert not layer.release_float_weight()  # already released
    double = Linear(8, 8).double()  # panels are a float32 layout: nothing else is released
    assert not double.release_float_weight() and "weight" in dict(double.named_parameters())


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_start():
    # torch's builder waits for as long as its lock file exists; a worker killed while holding
    # it used to leave every later start waiting at "loading our CPU kernels" forever.
    import subprocess
    import sys
    from pathlib import Path
    probe = ("import logging, sys; logging.basicConfig(); from worker.model import cpu_kernels as c; "
             "sys.exit(0 if c.load() is not None else 1)")
    lock = cpu_kernels.build_dir() / cpu_kernels.TORCH_BUILD_LOCK  # the subprocess's folder too: same environment
    lock.touch()
    (cpu_kernels.build_dir() / cpu_kernels.BUILT_STAMP).unlink(missing_ok=True)  # so the start goes through the builder
    try:
        again = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                               cwd=Path(__file__).parent.parent)
    finally:
        lock.unlink(missing_ok=True)
    assert again.returncode == 0, again.stderr
    assert "left by a process that died" in again.stderr


@needs_kernels
def test_a_start_after_a_build_loads_the_module_without_the_builder():
    # Importing torch's builder brings its compiler stack (over a second of every worker's start).
    import subprocess
    import sys
    from pathlib import Path
    assert cpu_kernels.load() is not None  # built and stamped
    probe = ("import sys; from worker.model import cpu_kernels as c; m = c.load(); "
             "print(m.__file__, 'torch.utils.cpp_extension' in sys.modules)")
    again = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).parent.parent)
    assert again.returncode == 0, again.stderr
    assert again.stdout.split() == [cpu_kernels.load().__file__, "False"]


@needs_kernels
def test_a_stamp_of_other_sources_or_a_missing_module_is_not_loaded(tmp_path):
    module = cpu_kernels.load()
    cpu_kernels._write_built_stamp(tmp_path, "digest-a", module)
    assert cpu_kernels._load_built(tmp_path, "digest-a").__file__ == module.__file__
    assert cpu_kernels._load_built(tmp_path, "digest-b") is None  # the sources changed: the builder rebuilds
    (tmp_path / cpu_kernels.BUILT_STAMP).write_text('{"key": "digest-a", "name": "x", "module": "/nowhere.so"}')
    assert cpu_kernels._load_built(tmp_path, "digest-a") is None
    (tmp_path / cpu_kernels.BUILT_STAMP).write_text("{not json")
    assert cpu_kernels._load_built(tmp_path, "digest-a") is None
    # A module that no longer loads (built against another Python, truncated, ...) is rebuilt, not fatal.
    (tmp_path / "broken.so").write_bytes(b"not a shared object")
    (tmp_path / cpu_kernels.BUILT_STAMP).write_text(
        '{"key": "digest-a", "name": "broken", "module": "%s"}' % (tmp_path / "broken.so"))
    assert cpu_kernels._load_built(tmp_path, "digest-a") is None


def test_two_source_trees_run_by_one_environment_build_apart(monkeypatch, tmp_path):
    # One shared folder made each checkout's start rebuild the other's module (minutes each time).
    mine = cpu_kernels.build_dir()
    monkeypatch.setattr(cpu_kernels, "_SOURCE_DIR", tmp_path / "csrc")
    assert cpu_kernels.build_dir() != mine and cpu_kernels.build_dir().parent == mine.parent
