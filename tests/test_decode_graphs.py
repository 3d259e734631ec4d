"""Decode steps from graphs (worker/decode_graphs.py): the padded, fixed-shape step computes what
the eager step computes, its padding rows write nowhere but the padding block, and only
decode-only steps take it. On the CPU the graphs run without capture (`capture=False`); the
capture itself is checked on CUDA (the last test, and tools/gpu_check.py)."""
from __future__ import annotations

import pytest
import torch

from worker import engine_builder
from worker.decode_graphs import DecodeGraphs, batch_buckets, query_buckets, width_bucket
from worker.engine import Engine, SamplingParams
from worker.model.attention import (AttentionMetadata, fixed_query_attention, paged_attention,
                                    paged_attention_reference)
from worker.model.weights import load_model

BLOCK = 4


def test_batch_buckets_cover_every_size_up_to_the_most():
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(1) == [1]
    assert batch_buckets(4) == [1, 2, 4]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(256) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 224, 256]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 100]
    for most in range(1, 70):
        sizes = batch_buckets(most)
        assert sizes == sorted(set(sizes)) and sizes[-1] == most


def test_width_bucket_is_the_next_power_of_two_capped():
    assert [width_bucket(n, 128) for n in (1, 2, 3, 5, 8, 9, 100, 128)] == [1, 2, 4, 8, 8, 16, 128, 128]
    assert width_bucket(70, 100) == 100


def test_query_buckets_run_from_one_token_to_the_longest_draft():
    assert query_buckets(1) == [1]
    assert query_buckets(9) == [1, 2, 4, 8, 9]
    assert query_buckets(8) == [1, 2, 4, 8]


def test_width_buckets_end_at_the_widest_table(llama_dir):
    model = load_model(llama_dir, torch.device("cpu"))
    for max_blocks, widths in ((8, [1, 2, 4, 8]), (6, [1, 2, 4, 6]), (1, [1])):
        graphs = DecodeGraphs(model, [], BLOCK, max_num_seqs=2, max_blocks_per_seq=max_blocks,
                              attention_fn=paged_attention, logits=torch.zeros(2, 8), padding_block=0,
                              capture=False)
        assert graphs.widths() == widths
        assert graphs.capture_all() == 0  # nothing to capture without CUDA


def _graphs_without_capture(monkeypatch):
    """Engines built after this run the modules (no CPU fast path) with graphs that do not capture."""
    monkeypatch.setattr(engine_builder, "choose_fast_path", lambda model, attention: (None, "the modules, for a test"))
    monkeypatch.setattr(engine_builder, "decode_graph_mode", lambda target, model, fast_path: "eager")


def _outputs(engine, prompts, n=12):
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True)
    return engine.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_with_decode_graphs_generates_what_the_eager_engine_does(checkpoints, monkeypatch, arch):
    monkeypatch.setattr(engine_builder, "choose_fast_path", lambda model, attention: (None, "the modules, for a test"))
    options = dict(device="cpu", num_kv_blocks=96, block_size=BLOCK, max_num_seqs=12)
    eager = Engine.from_model_dir(checkpoints[arch], **options)
    _graphs_without_capture(monkeypatch)
    graphed = Engine.from_model_dir(checkpoints[arch], **options)
    assert graphed.runner.decode_graphs is not None and eager.runner.decode_graphs is None
    # Batches that are not bucket sizes, contexts across several width buckets.
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (length,), generator=generator).tolist() for length in (3, 9, 17, 30, 5)]
    for batch in (prompts[:1], prompts[:3], prompts):
        expected, got = _outputs(eager, batch), _outputs(graphed, batch)
        for e, g in zip(expected, got):
            assert g.token_ids == e.token_ids
            assert g.logprobs == pytest.approx(e.logprobs, abs=1e-4)
    assert graphed.runner.decode_graphs.num_steps > 0
    graphed.check_integrity()


@pytest.mark.parametrize("new_tokens", [[[7], [8], [9]], [[7, 8], [9], [10, 11, 12]]])
def test_padding_rows_write_only_the_padding_block(llama_dir, new_tokens):
    model = load_model(llama_dir, torch.device("cpu"))
    config = model.config
    num_blocks, padding_block = 12, 11
    shape = (num_blocks, BLOCK, config.num_kv_heads, config.head_dim)
    kv = [(torch.randn(shape), torch.randn(shape)) for _ in range(config.num_layers)]
    before = [(k.clone(), v.clone()) for k, v in kv]
    logits = torch.zeros(32, config.vocab_size)
    graphs = DecodeGraphs(model, kv, BLOCK, max_num_seqs=8, max_blocks_per_seq=8, attention_fn=paged_attention,
                          logits=logits, padding_block=padding_block, capture=False, max_queries=4)
    # Three sequences: a batch of 4 with one padding row, and with drafts padding tokens too.
    tables, contexts = [[0, 1, 2], [3], [4, 5]], [9, 2, 4]
    with torch.inference_mode():
        out = graphs.run(new_tokens, contexts, tables)
    assert out.shape == (sum(map(len, new_tokens)), config.vocab_size)
    written = {(table[p // BLOCK], p % BLOCK) for table, ctx, tokens in zip(tables, contexts, new_tokens)
               for p in range(ctx, ctx + len(tokens))} | {(padding_block, 0)}
    for (k, v), (k0, v0) in zip(kv, before):
        for cache, old in ((k, k0), (v, v0)):
            changed = (cache != old).flatten(2).any(-1).nonzero().tolist()
            assert {tuple(c) for c in changed} == written


def test_graph_logits_match_an_eager_step(llama_dir):
    model = load_model(llama_dir, torch.device("cpu"))
    config = model.config
    shape = (10, BLOCK, config.num_kv_heads, config.head_dim)
    kv = [(torch.randn(shape), torch.randn(shape)) for _ in range(config.num_layers)]
    eager_kv = [(k.clone(), v.clone()) for k, v in kv]
    graphs = DecodeGraphs(model, kv, BLOCK, max_num_seqs=4, max_blocks_per_seq=4, attention_fn=paged_attention,
                          logits=torch.zeros(4, config.vocab_size), padding_block=9, capture=False)
    tables, contexts, tokens = [[0, 1, 2, 3], [4, 5]], [13, 5], [11, 12]
    with torch.inference_mode():
        got = graphs.run([[t] for t in tokens], contexts, tables)
        meta = AttentionMetadata.build(tables, contexts, [1, 1], BLOCK)
        hidden = model(torch.tensor(tokens), torch.tensor(contexts), eager_kv, meta, paged_attention)
        expected = model.compute_logits(hidden)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_only_plain_decode_steps_take_the_graphs(checkpoints, monkeypatch):
    _graphs_without_capture(monkeypatch)
    engine = Engine.from_model_dir(checkpoints["llama"], device="cpu", num_kv_blocks=64, block_size=BLOCK,
                                   max_num_seqs=4)
    graphs = engine.runner.decode_graphs
    _outputs(engine, [[5, 6, 7]], n=1)  # the prompt's step alone: no decode
    assert graphs.num_steps == 0
    _outputs(engine, [[5, 6, 7, 8]], n=6)
    assert graphs.num_steps == 5
    # A context past the widest bucket, or more sequences than the largest batch, run eagerly.
    assert not graphs.takes(1, engine.runner.max_blocks_per_seq * BLOCK + 1)
    assert graphs.takes(1, engine.runner.max_blocks_per_seq * BLOCK)
    assert graphs.takes(4, 1) and not graphs.takes(5, 1)


def test_steps_that_verify_drafts_generate_what_eager_steps_do(checkpoints, monkeypatch):
    monkeypatch.setattr(engine_builder, "choose_fast_path", lambda model, attention: (None, "the modules, for a test"))
    options = dict(device="cpu", num_kv_blocks=96, block_size=BLOCK, max_num_seqs=4, speculative_ngram_k=4,
                   speculative_ngram_max_step_tokens=0)
    eager = Engine.from_model_dir(checkpoints["llama"], **options)
    _graphs_without_capture(monkeypatch)
    graphed = Engine.from_model_dir(checkpoints["llama"], **options)
    # Repeated text: prompt lookup drafts at once, and drafts of several lengths meet in one step.
    prompts = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 5 + [14], [20, 21, 22, 23] * 4]
    for batch in (prompts[:1], prompts):
        expected, got = _outputs(eager, batch, n=24), _outputs(graphed, batch, n=24)
        for e, g in zip(expected, got):
            assert g.token_ids == e.token_ids
            assert g.logprobs == pytest.approx(e.logprobs, abs=1e-4)
    graphs = graphed.runner.decode_graphs
    assert graphed.stats().num_spec_draft_tokens > 0 and graphs.num_draft_steps > 0
    assert graphs.num_draft_steps < graphs.num_steps  # plain decode steps too
    graphed.check_integrity()


@pytest.mark.parametrize("queries", [2, 3, 5])
def test_fixed_query_attention_matches_the_reference(queries):
    generator = torch.Generator().manual_seed(queries)
    num_blocks, heads, kv_heads, dim = 24, 4, 2, 16
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=generator)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=generator)
    tables, contexts, new = [[3, 7, 1, 9], [2, 5, 11], [0, 4]], [9, 6, 2], [queries, 1, queries - 1]
    q = torch.randn(sum(new), heads, dim, generator=generator)
    reference = paged_attention_reference(q, None, None, k_cache, v_cache,
                                          AttentionMetadata.build(tables, contexts, new, BLOCK), 0.25)
    # The same tokens laid out `queries` a sequence, the rest padding that reads no one's keys.
    padded = torch.zeros(3 * queries, heads, dim)
    rows = [b * queries + i for b, n in enumerate(new) for i in range(n)]
    padded[rows] = q
    width = 4
    meta = AttentionMetadata(slot_mapping=torch.zeros(3 * queries, dtype=torch.int64),
                             block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                             seq_lens=torch.tensor([c + n for c, n in zip(contexts, new)]),
                             query_lens=[queries] * 3, context_lens=[width * BLOCK - queries] * 3, num_decodes=0)
    out = fixed_query_attention(padded, None, None, k_cache, v_cache, meta, 0.25, queries=queries,
                                context_lens=torch.tensor(contexts))
    torch.testing.assert_close(out[rows], reference, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_graphs_replay_what_eager_steps_compute(llama_dir):
    options = dict(device="cuda", dtype="float32", num_kv_blocks=64, block_size=BLOCK, max_num_seqs=8)
    eager = Engine.from_model_dir(llama_dir, cuda_graphs=False, **options)
    graphed = Engine.from_model_dir(llama_dir, **options)
    prompts = [[3 + i, 40 + i, 90, 7 * i + 1][: 2 + i % 3] for i in range(6)]
    for batch in (prompts[:1], prompts[:3], prompts):
        expected, got = _outputs(eager, batch), _outputs(graphed, batch)
        assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    graphs = graphed.runner.decode_graphs
    assert graphs.disabled is None and graphs.num_replays > 0
    # Every plain-decode bucket was captured at start-up: no step captured one.
    assert graphs.num_captures == len(graphs.batch_sizes) * len(graphs.widths()) == len(graphs._graphs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_draft_graphs_verify_what_eager_steps_do(llama_dir):
    options = dict(device="cuda", dtype="float32", num_kv_blocks=64, block_size=BLOCK, max_num_seqs=4,
                   speculative_ngram_k=4, speculative_ngram_max_step_tokens=0)
    eager = Engine.from_model_dir(llama_dir, cuda_graphs=False, **options)
    graphed = Engine.from_model_dir(llama_dir, **options)
    prompts = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 5 + [14]]
    expected, got = _outputs(eager, prompts, n=24), _outputs(graphed, prompts, n=24)
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    graphs = graphed.runner.decode_graphs
    assert graphs.drafts_disabled is None and graphs.num_draft_steps > 0
    assert graphs.num_captures > len(graphs.batch_sizes) * len(graphs.widths())  # draft graphs, on first use
