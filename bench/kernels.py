"""Our CPU kernels against torch's own path, shape by shape: `python -m bench.kernels`.

Shows whether the packed-panel linear kernel pays over BLAS at every row count (it is the
float32 path of `worker.model.layers.Linear` whenever the kernels build), which BLAS form
to use without it, and whether the paged decode and prefill attention kernels pay over SDPA
on gathered K/V. Prints ratios measured in this process, side by side.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

from worker.model import cpu_kernels
from worker.model.attention import AttentionMetadata, decode_attention, paged_attention
from worker.model.cpu_fast_path import kernel_paged_attention

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
    from worker.model.quantization import QuantizedLinear
    from worker.model.quantized_weight import quantize
    print("quantized linear: median ms per path (float32 ours | int8 ours / torch / dequant | "
          "int4 ours / torch / dequant); int4 groups of 128 (32 where K is not a multiple)")
    for n, k in SHAPES:
        weight = torch.randn(n, k)
        layers = {bits: QuantizedLinear(quantize(weight, bits, 128 if k % 128 == 0 else 32)) for bits in (8, 4)}
        float_layer = Linear(k, n, bias=False)
        float_layer.weight.data.copy_(weight)
        cells = []
        for rows in (1, 4, 16, 32, 128, 512):
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


# A model's projections (out, in) once per layer: enough layers that the weights stream from memory.
INT8_LAYOUT_MODELS = {"tinyllama-shape": ([(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)], 22),
                      "bench-small": ([(1024, 512), (512, 512), (2752, 512), (512, 1376)], 8)}


def bench_int8_layouts(kernels, passes: int) -> None:
    """Weight-only INT8 held as panels in the kernels' groups (what an engine on our kernels holds)
    against the row-major weight and against plain [P, K, 16] panels, every layer's projections
    one after another as a step runs them, the forms' passes alternating so a drifting host hits
    them all."""
    from worker.model.layers import pack_panels
    from worker.model.quantized_weight import quantize_int8
    group = kernels.int8_weight_panel_group()
    print(f"weight-only INT8 held as panels (groups of {group}): ratio of median pass times against row-major, "
          "then against plain panels (< 1: held faster)")
    for model, (shapes, num_layers) in INT8_LAYOUT_MODELS.items():
        layers = []
        for _ in range(num_layers):
            for n, k in shapes:
                qw = quantize_int8(torch.randn(n, k) * 0.02)
                layers.append((qw.qweight, pack_panels(qw.qweight), pack_panels(qw.qweight, group), qw.scales))
        cells = []
        for rows in (1, 2, 3, 4, 6, 8, 12, 16, 32):
            xs = {k: torch.randn(rows, k) for _, k in shapes}
            outs = {n: torch.empty(rows, n) for n, _ in shapes}
            def one_pass(form: int) -> float:
                start = time.perf_counter()
                for layer in layers:
                    kernels.linear_small_batch_int8(xs[layer[0].shape[1]], layer[form], layer[3],
                                                    outs[layer[0].shape[0]])
                return time.perf_counter() - start
            times = {0: [], 1: [], 2: []}
            for i in range(passes):
                for form in ((0, 1, 2) if i % 2 == 0 else (2, 1, 0)):
                    times[form].append(one_pass(form))
            held = statistics.median(times[2])
            cells.append(f"{rows}: {held / statistics.median(times[0]):.2f} / {held / statistics.median(times[1]):.2f}")
        print(f"  [{model}, {num_layers} layers] " + "  ".join(cells))


def _int4_projections(shapes: list[tuple[int, int]], num_layers: int) -> list:
    """Every layer's projections as random INT4 weights, groups of 128 (32 where K is not a multiple),
    with their group size."""
    from worker.model.quantized_weight import quantize
    projections = []
    for _ in range(num_layers):
        for n, k in shapes:
            group = 128 if k % 128 == 0 else 32
            projections.append((quantize(torch.randn(n, k) * 0.02, 4, group), group))
    return projections


def bench_int4_row_tiles(kernels, passes: int) -> None:
    """Weight-only INT4, one row of x per call, every layer's projections one after another: the
    FMA tile against the bf16 and int8 (VNNI) tiles where the build has them, passes alternating
    (in a rotating order), so a drifting host hits all; and which one the build picks here by
    itself."""
    chosen = kernels.int4_row_kernel()
    tiles = cpu_kernels.int4_row_tiles(kernels)
    print(f"weight-only INT4 one row, groups of 128 (32 where K is not a multiple): median pass ms and weight GB/s "
          f"per tile, and each tile's time over the FMA tile's (< 1: faster); this build has {', '.join(tiles)}; "
          f"this host picks {chosen}")
    try:
        for model, (shapes, num_layers) in INT8_LAYOUT_MODELS.items():
            layers = [(q.qweight, q.scales, q.zeros, group) for q, group in _int4_projections(shapes, num_layers)]
            weight_bytes = sum(q.numel() for q, _, _, _ in layers)
            xs = {k: torch.randn(1, k) for _, k in shapes}
            outs = {n: torch.empty(1, n) for n, _ in shapes}

            def one_pass(tile: str) -> float:
                kernels.int4_row_kernel(tile)
                start = time.perf_counter()
                for q, s, z, group in layers:
                    kernels.linear_small_batch_int4(xs[q.shape[1] * 2], q, s, z, group, outs[q.shape[0]])
                return time.perf_counter() - start
            times: dict[str, list[float]] = {tile: [] for tile in tiles}
            for i in range(passes):
                for tile in tiles[i % len(tiles):] + tiles[:i % len(tiles)]:
                    times[tile].append(one_pass(tile))
            med = {tile: statistics.median(t) for tile, t in times.items()}
            print(f"  [{model}, {num_layers} layers] " + ", ".join(
                f"{tile} {med[tile] * 1e3:.2f} ms ({weight_bytes / med[tile] / 1e9:.1f} GB/s, "
                f"{med[tile] / med['fma']:.2f}x)" for tile in tiles))
    finally:
        kernels.int4_row_kernel("auto")


def bench_int4_columns(kernels, passes: int) -> None:
    """INT4 with int8 activations on the output-major panels (AVX-512 VNNI): the group columns
    inside the panels (what a layer holds) against beside them, each form's tensors in one arena as
    an engine holds them (on 2 MiB pages where THP_MEM_ALLOC_ENABLE=1, as a worker sets it), every
    layer's projections one after another at 1, 2, 3, 4, 8 and 32 rows, passes alternating so a drifting
    host hits both."""
    from worker.model.int8_activation_panels import to_panels, with_group_columns
    from worker.model.weight_arena import gather
    if not kernels.int8_activations_output_major():
        raise SystemExit("only the output-major (AVX-512 VNNI) kernels hold group columns")
    print("INT4 + int8 activations, groups of 128 (32 where K is not a multiple): median pass ms with the group "
          "columns beside the panels, then inside them, and inside over beside (< 1: inside faster)")
    for model, (shapes, num_layers) in INT8_LAYOUT_MODELS.items():
        layers = []
        for q, group in _int4_projections(shapes, num_layers):
            panels = to_panels(q.qweight, 4, q.shape[1], group)
            layers.append((q, group, (panels, kernels.int8_activation_group_columns(q.scales, q.zeros)),
                           (with_group_columns(panels, q.scales, q.zeros, group), q.scales)))
        beside = gather([t for _, _, form, _ in layers for t in form])
        inside = gather([form[0] for _, _, _, form in layers])
        layers = [(q, group, (beside[2 * n], beside[2 * n + 1]), (inside[n], q.scales))
                  for n, (q, group, _, _) in enumerate(layers)]
        def run_layers(form: int, xs: dict, outs: dict) -> None:
            for q, group, *forms in layers:
                weight, scales = forms[form]
                kernels.linear_int4_weights_int8_activations(xs[q.shape[1]], weight, scales, q.zeros, group,
                                                             outs[q.shape[0]])
        print(f"  [{model}, {num_layers} layers] " + _two_forms_by_rows(shapes, passes, run_layers))


def _two_forms_by_rows(shapes: list[tuple[int, int]], passes: int, run_layers) -> str:
    """"rows: first / second ms (second over first)" at 1, 2, 3, 4, 8 and 32 rows, each the median
    pass of `run_layers(form, xs, outs)` (every layer once in form 0 or 1, x by in_features and out
    by out_features), the two forms' passes alternating in order."""
    cells = []
    for rows in (1, 2, 3, 4, 8, 32):
        xs = {k: torch.randn(rows, k) for _, k in shapes}
        outs = {n: torch.empty(rows, n) for n, _ in shapes}
        times: dict[int, list[float]] = {0: [], 1: []}
        for i in range(passes):
            for form in ((0, 1) if i % 2 == 0 else (1, 0)):
                start = time.perf_counter()
                run_layers(form, xs, outs)
                times[form].append(time.perf_counter() - start)
        first, second = statistics.median(times[0]), statistics.median(times[1])
        cells.append(f"{rows}: {first * 1e3:.2f} / {second * 1e3:.2f} ms ({second / first:.2f}x)")
    return "  ".join(cells)


def bench_int4_tiles(kernels, passes: int) -> None:
    """Weight-only INT4 on the AVX-512 kernels: held tiles (what a layer with groups of 128 holds,
    its scales and zeros inside) against the row-major weight with its scales and zeros, each
    form's tensors in one arena as an engine holds them (on 2 MiB pages where
    THP_MEM_ALLOC_ENABLE=1, as a worker sets it), every layer's projections one after another at
    1, 2, 3, 4, 8 and 32 rows, passes alternating so a drifting host hits both. Layers with other
    groups stay row-major in both."""
    from worker.model.int4_weight_tiles import to_tiles
    from worker.model.weight_arena import gather
    if not kernels.int4_weight_tiles_supported(128, 128):
        raise SystemExit("only the AVX-512 kernels take held INT4 tiles")
    print("weight-only INT4, groups of 128 (32 where K is not a multiple): median pass ms row-major, then held "
          "tiles, and held over row-major (< 1: held faster)")
    for model, (shapes, num_layers) in INT8_LAYOUT_MODELS.items():
        projections = _int4_projections(shapes, num_layers)
        row_major = gather([t for q, _ in projections for t in (q.qweight, q.scales, q.zeros)])
        held = gather([to_tiles(q.qweight, q.scales, q.zeros) if group == 128 else q.qweight
                       for q, group in projections])
        layers = [(group, row_major[3 * n + 1], row_major[3 * n + 2], row_major[3 * n], held[n])
                  for n, (_, group) in enumerate(projections)]
        def run_layers(form: int, xs: dict, outs: dict) -> None:
            for group, scales, zeros, *weights in layers:
                n, k = scales.shape[0], scales.shape[1] * group
                kernels.linear_small_batch_int4(xs[k], weights[form], scales, zeros, group, outs[n])
        print(f"  [{model}, {num_layers} layers] " + _two_forms_by_rows(shapes, passes, run_layers))


NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 4, 64  # bench-small's attention


def _scattered_tables(lens: list[int], block_size: int, num_blocks: int) -> list[list[int]]:
    """One block table per sequence over randomly scattered blocks."""
    free = torch.randperm(num_blocks).tolist()
    tables = []
    for length in lens:
        n = -(-length // block_size)
        tables.append(free[:n])
        free = free[n:]
    return tables


def _pools(num_blocks: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    k_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    return k_cache, torch.randn_like(k_cache)


def bench_decode_attention(kernels, repeats: int, num_seqs: int = 32, block_size: int = 16) -> None:
    rng = random.Random(0)
    k_cache, v_cache = _pools(1200, block_size)
    lens = sorted((rng.randint(64, 768) for _ in range(num_seqs)), reverse=True)
    meta = AttentionMetadata.build(_scattered_tables(lens, block_size, k_cache.shape[0]), [n - 1 for n in lens],
                                   [1] * num_seqs, block_size)
    q = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM)
    out = torch.empty_like(q)
    ref = timed_ms(lambda: decode_attention(q, k_cache, v_cache, meta, 0.125, out), repeats)  # groups of 8
    ours = timed_ms(lambda: kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.125),
                    repeats)
    print(f"decode attention, {num_seqs} sequences of 64..768 tokens: SDPA over gathered K/V {ref:.2f} ms, "
          f"our kernel {ours:.2f} ms ({ref / ours:.2f}x)")


# Prompt-chunk steps as the engine's 512-token budget makes them: (new tokens, cached context) per sequence.
PREFILL_STEPS = [[(512, 0)], [(256, 0), (256, 0)], [(200, 300), (312, 0)], [(64, 448)]]


def bench_prefill_attention(kernels, repeats: int, block_size: int = 16) -> None:
    """Our prefill kernel against the torch path (SDPA per chunk over gathered context), each
    through its whole attention function, so both sides include what the engine runs around them."""
    print("prefill attention, one step's prompt chunks (new tokens + cached context), median ms "
          "(torch SDPA path / our kernel, ratio > 1 means ours is faster)")
    cells = []
    for chunks in PREFILL_STEPS:
        lens = [n + c for n, c in chunks]
        k_cache, v_cache = _pools(sum(-(-n // block_size) for n in lens) + 1, block_size)
        meta = AttentionMetadata.build(_scattered_tables(lens, block_size, k_cache.shape[0]),
                                       [c for _, c in chunks], [n for n, _ in chunks], block_size)
        tokens = sum(meta.query_lens)
        q = torch.randn(tokens, NUM_HEADS, HEAD_DIM)
        k, v = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM), torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM)
        ours = timed_ms(lambda: kernel_paged_attention(kernels, q, k, v, k_cache, v_cache, meta, 0.125), repeats)
        ref = timed_ms(lambda: paged_attention(q, k, v, k_cache, v_cache, meta, 0.125), repeats)
        label = " + ".join(f"{n}" + (f"@{c}" if c else "") for n, c in chunks)
        cells.append(f"{label}: {ref:.2f}/{ours:.2f} ({ref / ours:.2f}x)")
    print("  " + "   ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quantized", action="store_true", help="only the quantized linear paths")
    parser.add_argument("--int8-layouts", action="store_true",
                        help="only weight-only INT8, per call: held panels against row-major and against plain panels")
    parser.add_argument("--int4-row-tiles", action="store_true",
                        help="only weight-only INT4, one row per call: the FMA tile against the bf16 and int8 tiles")
    parser.add_argument("--int4-columns", action="store_true",
                        help="only INT4 with int8 activations: group columns inside the panels against beside them")
    parser.add_argument("--int4-tiles", action="store_true",
                        help="only weight-only INT4: held tiles against the row-major weight, scales and zeros")
    args = parser.parse_args()
    torch.manual_seed(0)
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("the CPU kernels could not be built here (no compiler or ninja?)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with torch.inference_mode():  # as a worker runs: the float layers' `out=` refuses autograd
        if args.quantized:
            return bench_quantized_linear(args.repeats)
        if args.int8_layouts:
            return bench_int8_layouts(kernels, max(2, args.repeats // 2))
        if args.int4_row_tiles:
            return bench_int4_row_tiles(kernels, max(2, args.repeats // 2))
        if args.int4_columns:
            return bench_int4_columns(kernels, max(2, args.repeats // 2))
        if args.int4_tiles:
            return bench_int4_tiles(kernels, max(2, args.repeats // 2))
        bench_linear(kernels, args.repeats)
        bench_transposed_form(args.repeats)
        bench_decode_attention(kernels, args.repeats)
        bench_prefill_attention(kernels, args.repeats)
        bench_quantized_linear(args.repeats)


if __name__ == "__main__":
    main()
