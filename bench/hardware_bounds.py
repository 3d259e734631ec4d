"""Hardware ceilings for the benchmark: measured float32 matmul rate, copy and read bandwidth, and the workload's
FLOPs and per-token weight bytes derived from the model config, which turn those rates into time bounds."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

BYTES_PER_PARAM = 4  # float32, unless a caller says what its weights are held in

# Shapes the workload actually runs: prefill chunks of a few hundred tokens through the block's projections,
# and the LM head for a decode batch. The best of them is taken as the machine's attainable rate.
MATMUL_SHAPES = [
    (512, 512, 1376),   # 512-token chunk @ gate/up projection
    (512, 1376, 512),   # 512-token chunk @ down projection
    (1024, 512, 1376),  # 1024-token chunk @ gate/up projection
    (1024, 512, 512),   # 1024-token chunk @ q/o projection
    (32, 512, 32000),   # decode batch of 32 @ LM head
]


@dataclass
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, cfg) -> "ModelShape":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                   head_dim, cfg.intermediate_size, cfg.vocab_size)

    @property
    def block_linear_params(self) -> int:
        """Matmul weights of all decoder blocks (q, k, v, o, gate, up, down): the 'non-embedding parameters'.
        RMSNorm weights are left out: they are elementwise, not matmuls, and are <0.1% of the total."""
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d + 2 * h * self.kv_heads * d + self.heads * d * h
        mlp = 3 * h * self.intermediate
        return self.layers * (attn + mlp)

    @property
    def lm_head_params(self) -> int:
        return self.hidden * self.vocab


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_matmul_gflops(repeats: int = 15) -> dict:
    """Median torch.mm time per shape -> GFLOP/s; the best shape's rate is the bound (it is attainable)."""
    per_shape = {}
    for m, k, n in MATMUL_SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        out = torch.empty(m, n)
        for _ in range(3):  # warm caches and MKL's kernel selection
            torch.mm(a, b, out=out)
        sec = _median_seconds(lambda: torch.mm(a, b, out=out), repeats)
        per_shape[f"[{m}x{k}]@[{k}x{n}]"] = 2 * m * k * n / sec / 1e9
    return {"gflops": max(per_shape.values()), "per_shape_gflops": per_shape}


def measure_copy_gbps(mib: int = 256, repeats: int = 7) -> float:
    """Median large-tensor copy rate, counting bytes read + bytes written (what a weight stream costs)."""
    n = mib * 2**20 // 4
    src, dst = torch.rand(n), torch.empty(n)
    dst.copy_(src)  # fault pages in before timing
    sec = _median_seconds(lambda: dst.copy_(src), repeats)
    return 2 * n * 4 / sec / 1e9


def measure_read_gbps(mib: int = 256, repeats: int = 7) -> float:
    """Median large-tensor read rate: a float32 matrix-vector product through torch's BLAS over the tensor (bytes
    read, nothing written), a weight stream as a tuned library runs it. A copy also writes, and on most hosts its
    read + write rate is below what reads alone reach; a plain sum, one reduction chain, stays below both."""
    matrix = torch.rand(mib * 2**20 // 4 // 8192, 8192)
    vector = torch.ones(8192)
    torch.mv(matrix, vector)  # fault pages in before timing
    sec = _median_seconds(lambda: torch.mv(matrix, vector), repeats)
    return matrix.numel() * 4 / sec / 1e9


def request_flops(shape: ModelShape, prompt_len: int, output_len: int) -> dict:
    """FLOPs a correct engine must spend on one request.

    Processed tokens: the prompt plus every generated token except the last (which is sampled, never fed back),
    each costing 2 x block_linear_params, plus causal attention 4 x context x hidden per layer (QK^T and PV) where
    context = the token's position + 1. The LM head (2 x hidden x vocab) runs once per GENERATED token only."""
    processed = prompt_len + output_len - 1
    linear = 2 * shape.block_linear_params * processed
    # sum over positions p=0..processed-1 of (p+1) = processed*(processed+1)/2
    attn = 4 * shape.hidden * shape.layers * processed * (processed + 1) // 2
    lm_head = 2 * shape.lm_head_params * output_len
    return {"linear": linear, "attention": attn, "lm_head": lm_head, "total": linear + attn + lm_head}


def workload_flops(shape: ModelShape, lengths: list[tuple[int, int]]) -> dict:
    total = {"linear": 0, "attention": 0, "lm_head": 0, "total": 0}
    for p, o in lengths:
        for k, v in request_flops(shape, p, o).items():
            total[k] += v
    return total


def decode_bytes_per_token(shape: ModelShape, bytes_per_param: int = BYTES_PER_PARAM) -> int:
    """Weight bytes streamed per decoded token at batch 1: all block linears + LM head (not the embedding table,
    of which only one row is gathered). The KV cache read is left out, which keeps this a true upper bound."""
    return (shape.block_linear_params + shape.lm_head_params) * bytes_per_param

