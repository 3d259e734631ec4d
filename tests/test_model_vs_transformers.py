"""Our transformer and engine against Hugging Face transformers on the same tiny checkpoints."""
from __future__ import annotations

import pytest
import torch
import transformers

from conftest import ARCHITECTURES
from engine_steps import drain
from worker.engine import Engine, SamplingParams
from worker.model import cpu_kernels
from worker.model.attention import AttentionMetadata, paged_attention, paged_attention_reference
from worker.model.cpu_fast_path import choose_fast_path
from worker.model.weights import load_model

PROMPT_LENGTHS = (1, 5, 16, 17, 31, 48, 64, 100)
GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def _prompts(seed: int, lengths=PROMPT_LENGTHS, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    return {arch: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for arch, path in checkpoints.items()}


@pytest.fixture(scope="module")
def hf_greedy(hf_models):
    """32-token greedy continuations from transformers' generate, per architecture."""
    prompts = _prompts(1)
    # No EOS at all (rather than min_new_tokens, which masks EOS out of the argmax):
    # the same contract as our ignore_eos.
    config = transformers.GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    result = {}
    for arch, model in hf_models.items():
        model.generation_config.eos_token_id = None
        outs = []
        for p in prompts:
            ids = model.generate(torch.tensor([p]), generation_config=config)
            outs.append(ids[0, len(p):].tolist())
        result[arch] = (prompts, outs)
    return result


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("attention_fn", [paged_attention, paged_attention_reference, "cpu fast path"])
def test_prompt_logits_match_transformers(arch, attention_fn, checkpoints, hf_models):
    ours = load_model(checkpoints[arch])
    computes = ours
    if attention_fn == "cpu fast path":
        if cpu_kernels.load() is None:
            pytest.skip("our CPU kernels did not build")
        computes, _ = choose_fast_path(ours)
    config = ours.config
    ids = torch.tensor(_prompts(2, lengths=(45,))[0])
    with torch.no_grad():
        expected = hf_models[arch](ids[None]).logits[0]  # [T, V]
    block_size, num_blocks = 16, 8
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_layers)]
    table = [5, 2, 7]  # deliberately out of order: attention must follow the table
    meta = AttentionMetadata.build([table], [0], [len(ids)], block_size)
    with torch.no_grad():
        if computes is ours:
            hidden = ours(ids, torch.arange(len(ids)), kv, meta, attention_fn)
        else:
            hidden = computes.forward(ids, torch.arange(len(ids)), kv, meta)
        logits = computes.compute_logits(hidden)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_continuations_match_transformers_generate(arch, checkpoints, hf_greedy):
    prompts, expected = hf_greedy[arch]
    engine = Engine.from_model_dir(checkpoints[arch], num_kv_blocks=128)
    for prompt, want in zip(prompts, expected):
        (out,) = engine.generate([prompt], GREEDY_32, use_tqdm=False)
        assert out.token_ids == want
        assert out.finish_reason == "length"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_crowd_preemption_chunking_and_prefix_hits_do_not_change_greedy_outputs(arch, checkpoints, hf_greedy):
    prompts, expected = hf_greedy[arch]
    shared_prefix = _prompts(3, lengths=(48,))[0]
    # 8 other requests: 4 random, 4 sharing a 48-token (3-block) prefix so they hit the cache.
    others = _prompts(4, lengths=(20, 40, 60, 80)) + [shared_prefix + tail for tail in _prompts(5, (3, 9, 17, 30))]
    engine = Engine.from_model_dir(checkpoints[arch], num_kv_blocks=256, max_num_seqs=16)
    solo_others = [engine.generate([p], GREEDY_32, use_tqdm=False)[0].token_ids for p in others]

    # A pool far too small for 16 concurrent requests forces preemption; chunks of 16 tokens.
    crowd = Engine.from_model_dir(checkpoints[arch], num_kv_blocks=40, max_num_seqs=16,
                                  max_prefill_chunk_tokens=16, max_num_batched_tokens=64)
    # Warm the prefix cache with the shared prefix, then queue the sharers first so they
    # are admitted before pool pressure evicts it.
    crowd.generate([shared_prefix + [7]], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    requests = list(zip([f"other{i}" for i in range(len(others))], others))[::-1]
    requests += list(zip([f"prompt{i}" for i in range(len(prompts))], prompts))
    for request_id, prompt in requests:
        crowd.add_request(request_id, prompt, GREEDY_32)
    final = drain(crowd)
    crowd.block_manager.evict()
    assert crowd.block_manager.num_free_blocks == crowd.block_manager.num_blocks
    assert [final[f"prompt{i}"].token_ids for i in range(len(prompts))] == expected
    assert [final[f"other{i}"].token_ids for i in range(len(others))] == solo_others
    assert crowd.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert [final[f"other{i}"].num_cached_tokens for i in range(4, 8)] == [48] * 4


def test_greedy_stops_where_transformers_does_on_an_eos_named_only_in_generation_config(served_checkpoint, tmp_path):
    """transformers' generate stops on generation_config.json's eos_token_id; so does the engine."""
    import json
    import shutil
    prompt = [1, 50, 60, 70, 80]
    free = Engine.from_model_dir(served_checkpoint, num_kv_blocks=64).generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), use_tqdm=False)[0].token_ids
    stop_at = next(i for i, t in enumerate(free) if i >= 3 and t not in free[:i])  # first seen at i >= 3
    checkpoint = tmp_path / "llama"
    shutil.copytree(served_checkpoint, checkpoint)
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    generation["eos_token_id"] = [generation.get("eos_token_id") or 1, free[stop_at]]
    (checkpoint / "generation_config.json").write_text(json.dumps(generation))
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):].tolist()
    out = Engine.from_model_dir(checkpoint, num_kv_blocks=64).generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)[0]
    assert out.token_ids == expected == free[:stop_at + 1] and out.finish_reason == "stop"
