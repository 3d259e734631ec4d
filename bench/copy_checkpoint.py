"""A Llama checkpoint whose weights make it copy: it continues any prompt by repeating the prompt's last
`period` tokens over and over. Built by hand (no training, nothing downloaded) for the speculative-decoding
benchmark and tests: the workload where prompt lookup finds every draft.

How it copies. Every embedding row is a random unit vector in the first T = num_kv_heads x head_dim
dimensions (the token's identity) plus a constant 1 in the last dimension. Layer 0's queries and keys
read only that constant, so each is the same vector at every position; rotary embedding then makes a
query-key score depend only on the distance between them, and the query is the key turned back by
(period - 1) positions' angles, so the score peaks where t - s = period - 1 (sharply: its amplitude is set
from the smallest gap between the peak and any other distance). Values carry the token dimensions,
o_proj writes them back scaled by `copy_gain`, and the head is the embedding: the next token is the
one period - 1 positions back, x[t + 1 - period]. Every other layer has zero o_proj and down_proj, so it
costs what a layer costs and changes nothing.
"""
from __future__ import annotations

import math
from pathlib import Path

COPY_GAIN = 8.0  # the copied token's weight in the residual against the current token's 1
# Attention logit gap between the copied position and any other: e^-30 leaves nothing elsewhere.
SCORE_GAP = 30.0


def make_copy_checkpoint(path: str | Path, period: int = 64, seed: int = 0, logit_scale: float = 1.0,
                         **config) -> Path:
    """Write the copying checkpoint into `path` and return it. `config`: LlamaConfig fields (hidden_size,
    num_hidden_layers, heads, vocab_size, ...); `logit_scale` scales the head, so sampling at temperature 1
    is as peaked as a test wants."""
    import torch
    import transformers

    settings = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    settings.update(config)
    cfg = transformers.LlamaConfig(**settings)
    hidden, heads, kv_heads = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    token_dims = kv_heads * head_dim
    if token_dims >= hidden:
        raise ValueError(f"num_key_value_heads x head_dim = {token_dims} must be < hidden_size = {hidden}")
    if not 1 <= period < cfg.max_position_embeddings:
        raise ValueError(f"period must be in [1, max_position_embeddings), got {period}")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).float()
    const = hidden - 1
    # The normed input's scale: every embedding row has norm sqrt(2), so RMSNorm multiplies it by this.
    norm_scale = math.sqrt(hidden / 2)
    base = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    theta = [base ** (-2 * i / head_dim) for i in range(head_dim // 2)]
    offset = period - 1  # the next token is the one this many positions back
    # Score(d) = A * sum_i cos((d - offset) theta_i); its gap to the peak is smallest for some d near it.
    gaps = [sum(1 - math.cos(d * t) for t in theta) for d in range(1, cfg.max_position_embeddings)]
    amplitude = SCORE_GAP / min(gaps)  # A = a^2 / sqrt(head_dim)
    a = math.sqrt(amplitude * math.sqrt(head_dim))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        tokens = torch.randn(cfg.vocab_size, token_dims)
        if cfg.vocab_size <= token_dims:  # orthonormal where the vocabulary fits: no token resembles another
            tokens = torch.linalg.qr(torch.randn(token_dims, token_dims))[0][:cfg.vocab_size]
        tokens = tokens / tokens.norm(dim=1, keepdim=True)
        embed = model.model.embed_tokens.weight
        embed[:, :token_dims] = tokens
        embed[:, const] = 1.0
        model.lm_head.weight[:, :token_dims] = tokens * logit_scale
        attn = model.model.layers[0].self_attn
        half = head_dim // 2
        for h in range(kv_heads):
            # Keys: the real part a in every rotary pair; values: this head's slice of the token dims.
            attn.k_proj.weight[h * head_dim:h * head_dim + half, const] = a / norm_scale
            for d in range(head_dim):
                attn.v_proj.weight[h * head_dim + d, h * head_dim + d] = 1.0 / norm_scale
        for g in range(heads):
            for i, t in enumerate(theta):  # the query is the key rotated back by `offset` positions
                attn.q_proj.weight[g * head_dim + i, const] = a * math.cos(offset * t) / norm_scale
                attn.q_proj.weight[g * head_dim + half + i, const] = -a * math.sin(offset * t) / norm_scale
        group = heads // kv_heads
        for h in range(kv_heads):  # the first query head of each group writes its KV head's values back
            g = h * group
            for d in range(head_dim):
                attn.o_proj.weight[h * head_dim + d, g * head_dim + d] = COPY_GAIN
    path = Path(path)
    model.save_pretrained(path)
    return path
