"""Loading checkpoints: sharded files, tied embeddings, clear errors, KV pool sizing."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import make_checkpoint
from worker.kv_cache import bytes_per_block, num_blocks_for_budget
from worker.model.config import CheckpointError, ModelConfig
from worker.model.weights import load_model


def _hf_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids[None]).logits[0, -1]


def _our_last_logits(path, ids):
    from worker.engine import Engine
    engine = Engine.from_model_dir(path, num_kv_blocks=16)
    model, runner = engine.model, engine.runner
    from worker.model_runner import SequenceStep
    from shared.sampling_params import SamplingParams
    engine.block_manager.allocate_slots("x", len(ids))
    step = SequenceStep(ids.tolist(), 0, engine.block_manager.block_table("x"), True,
                        SamplingParams(temperature=0.0), None, ids.tolist())
    with torch.inference_mode():
        input_ids, positions, meta, logits_indices, *_ = runner._prepare([step])
        hidden = model(input_ids, positions, runner.kv_caches, meta)
        return model.compute_logits(hidden[logits_indices])[0]


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    single = make_checkpoint(tmp_path / "single", "llama", seed=3)
    model = transformers.AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2, "the checkpoint should really be sharded"
    a = load_model(single).state_dict()
    b = load_model(tmp_path / "sharded").state_dict()
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)


def test_tied_embeddings_match_transformers(tmp_path):
    path = make_checkpoint(tmp_path / "tied", "qwen2", seed=4, tie_word_embeddings=True)
    assert ModelConfig.from_model_dir(path).tie_word_embeddings
    ids = torch.tensor([5, 9, 13, 200, 7])
    torch.testing.assert_close(_our_last_logits(path, ids), _hf_logits(path, ids), rtol=0, atol=1e-4)
    model = load_model(path)
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()


def test_missing_and_unexpected_weights_are_named(tmp_path):
    path = make_checkpoint(tmp_path / "broken", "llama", seed=5)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="extra"):
        load_model(path)
    del tensors["model.layers.0.self_attn.extra.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing weights: \['model.layers.1.mlp.up_proj.weight'\]"):
        load_model(path)


@pytest.mark.parametrize("resize, message", [
    # The same total rows split wrongly between q and k would pass as the fused whole.
    ({"model.layers.0.self_attn.q_proj.weight": 48, "model.layers.0.self_attn.k_proj.weight": 48},
     r"weight model.layers.0.self_attn.(q_proj.weight has shape \(48, 64\), expected \(64, 64\)|"
     r"k_proj.weight has shape \(48, 64\), expected \(32, 64\))"),
    ({"model.layers.0.self_attn.k_proj.weight": 16},
     r"weight model.layers.0.self_attn.k_proj.weight has shape \(16, 64\), expected \(32, 64\)"),
    ({"model.layers.1.mlp.gate_proj.weight": 100, "model.layers.1.mlp.up_proj.weight": 156},
     r"weight model.layers.1.mlp.gate_proj.weight has shape \(100, 64\), expected \(128, 64\)"),
])
def test_each_part_of_a_fused_weight_is_checked_under_its_own_name(tmp_path, resize, message):
    path = make_checkpoint(tmp_path / "split", "llama", seed=5)
    tensors = load_file(path / "model.safetensors")
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)  # the shapes the cases assume
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)
    assert tensors["model.layers.1.mlp.gate_proj.weight"].shape == (128, 64)
    for name, rows in resize.items():
        tensors[name] = torch.randn(rows, tensors[name].shape[1])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=message):
        load_model(path)


def test_a_truncated_or_unindexed_shard_is_named(tmp_path):
    path = make_checkpoint(tmp_path / "cut", "llama", seed=5)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=f"{weights} does not read as safetensors"):
        load_model(path)
    index = path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="has no 'weight_map'"):
        load_model(path)
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"names shards that are not in .*model-00002-of-00002"):
        load_model(path)


def test_folder_without_safetensors_is_refused(tmp_path):
    path = make_checkpoint(tmp_path / "nofile", "llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(path)


def test_cpu_pool_is_sized_from_the_byte_budget():
    config = ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        vocab_size=100))
    per_block = bytes_per_block(config, 16, torch.float32)
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4  # K and V, layers, slots, kv heads, head dim, bytes
    assert num_blocks_for_budget(config, 16, torch.float32, 10 * per_block + per_block // 2) == 10
    with pytest.raises(ValueError, match="smaller than one block"):
        num_blocks_for_budget(config, 16, torch.float32, per_block - 1)
