"""Our CPU kernels against torch's own path, shape by shape: `python -m bench.kernels`.

Shows whether the packed-panel linear kernel pays over BLAS at every row count (it is the
float32 path of `worker.model.layers.Linear` whenever the kernels build), which BLAS form
to use without it, and whether the paged decode-attention kernel pays over SDPA on
gathered K/V. Prints ratios measured in this process, side by side.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

from worker.model import cpu_kernels
from worker.model.attention import _decode_attention

# bench-small's linear shapes (out, in): qkv, gate_up, down, o, lm_head.
SHAPES = [(1024, 512), (2752, 512), (512, 1376), (512, 512), (32000, 512)]


def timed_ms(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def bench_linear(kernels, repeats: int) -> None:
    from worker.model.layers import linear, pack_panels
    print("linear: x [M, K] @ W[N, K]^T, median ms (BLAS in its faster form / our packed kernel, "
          "ratio > 1 means ours is faster)")
    for n, k in SHAPES:
        weight = torch.randn(n, k)
        packed = pack_panels(weight)
        cells = []
        for rows in (1, 4, 8, 16, 32, 64, 128, 512):
            x = torch.randn(rows, k)
            out = torch.empty(rows, n)
            kernels.linear_packed(x, packed, out)
            torch.testing.assert_close(out, x @ weight.t(), atol=1e-3, rtol=1e-4)
            ref = timed_ms(lambda: linear(x, weight, out=out), repeats)
            ours = timed_ms(lambda: kernels.linear_packed(x, packed, out), repeats)
            cells.append(f"M={rows}: {ref:.2f}/{ours:.2f} ({ref / ours:.2f}x)")
        print(f"  [{n}x{k}] " + "  ".join(cells))


def bench_transposed_form(repeats: int) -> None:
    print("BLAS forms: x W^T / (W x^T)^T, ratio of median times (> 1: the transposed form is faster)")
    for n, k in SHAPES:
        weight = torch.randn(n, k)
        cells = []
        for rows in (3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256):
            x = torch.randn(rows, k)
            out = torch.empty(rows, n)
            plain = timed_ms(lambda: F.linear(x, weight), repeats)
            transposed = timed_ms(lambda: out.copy_(torch.mm(weight, x.t()).t()), repeats)
            cells.append(f"{rows}:{plain / transposed:.2f}")
        print(f"  [{n}x{k}] " + "  ".join(cells))


def bench_quantized_linear(repeats: int) -> None:
    """Each quantized compute path against the float32 kernel, at decode and prefill sizes."""
    from worker.model.layers import Linear
    from worker.model.quantization import QuantizedLinear, quantize
    print("quantized linear: median ms per path (float32 ours | int8 ours / torch / dequant | "
          "int4 ours / torch / dequant); int4 groups of 128 (32 where K is not a multiple)")
    for n, k in SHAPES:
        weight = torch.randn(n, k)
        layers = {bits: QuantizedLinear(quantize(weight, bits, 128 if k % 128 == 0 else 32)) for bits in (8, 4)}
        float_layer = Linear(k, n, bias=False)
        float_layer.weight.data.copy_(weight)
        cells = []
        for rows in (1, 4, 16, 128):
            x = torch.randn(rows, k)
            out = torch.empty(rows, n)
            row = [timed_ms(lambda: float_layer(x, out=out), repeats)]
            for layer in layers.values():
                for path in ("ours", "kernel", "dequant"):
                    layer.path = layer.small_path = path
                    row.append(timed_ms(lambda: layer(x), max(3, repeats // 4)) if layer.path_available(
                        path, x.device) else float("nan"))
            cells.append(f"M={rows}: {row[0]:.2f} | " + " / ".join(f"{v:.2f}" for v in row[1:4]) + " | "
                         + " / ".join(f"{v:.2f}" for v in row[4:]))
        print(f"  [{n}x{k}] " + "   ".join(cells))


def bench_decode_attention(kernels, repeats: int, num_seqs: int = 32, block_size: int = 16) -> None:
    rng = random.Random(0)
    num_blocks, num_kv_heads, head_dim, num_heads = 1200, 4, 64, 8
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    lens = sorted((rng.randint(64, 768) for _ in range(num_seqs)), reverse=True)
    free = torch.randperm(num_blocks).tolist()
    tables = []
    for length in lens:
        n = -(-length // block_size)
        tables.append(free[:n])
        free = free[n:]
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    seq_lens = torch.tensor(lens)
    q = torch.randn(num_seqs, num_heads, head_dim)

    def grouped_sdpa():
        for s in range(0, num_seqs, 8):
            _decode_attention(q[s:s + 8], k_cache, v_cache, block_tables[s:s + 8], seq_lens[s:s + 8], lens[s], 0.125)

    ref = timed_ms(grouped_sdpa, repeats)
    ours = timed_ms(lambda: kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125),
                    repeats)
    print(f"decode attention, {num_seqs} sequences of 64..768 tokens: SDPA over gathered K/V {ref:.2f} ms, "
          f"our kernel {ours:.2f} ms ({ref / ours:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quantized", action="store_true", help="only the quantized linear paths")
    args = parser.parse_args()
    torch.manual_seed(0)
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("the CPU kernels could not be built here (no compiler or ninja?)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.quantized:
        return bench_quantized_linear(args.repeats)
    bench_linear(kernels, args.repeats)
    bench_transposed_form(args.repeats)
    bench_decode_attention(kernels, args.repeats)
    bench_quantized_linear(args.repeats)


if __name__ == "__main__":
    main()
