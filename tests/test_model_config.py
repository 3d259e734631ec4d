"""Config parsing: what we support is read correctly, what we do not is refused by name."""
from __future__ import annotations

import json
import math

import pytest
import torch

from worker.model.config import CheckpointError, ModelConfig, RopeConfig, UnsupportedModelError
from worker.model.layers import rope_inverse_frequencies

BASE = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=100)


@pytest.mark.parametrize("extra, message", [
    (dict(architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
    (dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64), "sliding window"),
    (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=64, use_sliding_window=True),
     "sliding window"),
    (dict(num_local_experts=8), "mixture of experts"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "dynamic"),
    (dict(hidden_act="gelu"), "gelu"),
    (dict(num_key_value_heads=3), "multiple"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "sliding_attention"),
])
def test_unsupported_features_are_refused_by_name(extra, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_dict({**BASE, **extra})


def _without(key: str) -> dict:
    return {k: v for k, v in BASE.items() if k != key}


@pytest.mark.parametrize("config, message", [
    (_without("num_attention_heads"), "config.json has no 'num_attention_heads'"),
    (_without("vocab_size"), "config.json has no 'vocab_size'"),
    ({**BASE, "vocab_size": None}, "config.json has no 'vocab_size'"),
    ({**BASE, "hidden_size": "64"}, "'hidden_size' is '64'; it must be an integer"),
    ({**BASE, "num_hidden_layers": 2.5}, "'num_hidden_layers' is 2.5; it must be an integer"),
    ({**BASE, "rms_norm_eps": math.inf}, "'rms_norm_eps' is inf; it must be a number"),
    ({**BASE, "intermediate_size": 0}, "'intermediate_size' is 0; it must be at least 1"),
    ({**BASE, "rms_norm_eps": [1e-6]}, "'rms_norm_eps' is \\[1e-06\\]; it must be a number"),
    ({**BASE, "rope_scaling": {"rope_type": "linear"}}, "rope_scaling has no 'factor'"),
    ({**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "rope_parameters has no 'factor'"),
    ({**BASE, "rope_scaling": "linear"}, "'rope_scaling' is 'linear'; it must be an object"),
    ({**BASE, "eos_token_id": "2"}, "'eos_token_id' is '2'; it must be a token id"),
])
def test_a_malformed_config_is_refused_naming_the_key(config, message):
    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_dict(config)


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "holds a JSON list, not an object"),
    ("{\"hidden_size\": 64,", "config.json does not read as JSON"),
])
def test_a_config_json_that_is_not_an_object_is_refused_naming_the_file(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_model_dir(tmp_path)


def test_qwen2_sliding_window_value_without_use_flag_is_accepted():
    config = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096,
                                    "use_sliding_window": False})
    assert config.family == "qwen2" and config.qkv_bias and not config.o_bias


def test_old_and_new_rope_formats_read_the_same():
    old = ModelConfig.from_dict({**BASE, "rope_theta": 5e5, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    new = ModelConfig.from_dict({**BASE, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert old.rope == new.rope == RopeConfig(theta=5e5, rope_type="llama3", factor=8.0)


def test_llama3_rope_scaling_bands():
    rope = RopeConfig(theta=5e5, rope_type="llama3", factor=8.0, original_max_position_embeddings=8192)
    base = rope_inverse_frequencies(128, RopeConfig(theta=5e5))
    scaled = rope_inverse_frequencies(128, rope)
    wavelen = 2 * math.pi / base
    high = wavelen < 8192 / 4.0  # short wavelengths: unchanged
    low = wavelen > 8192 / 1.0  # long wavelengths: divided by factor
    torch.testing.assert_close(scaled[high], base[high])
    torch.testing.assert_close(scaled[low], base[low] / 8.0)
    mid = ~high & ~low
    assert mid.any() and torch.all(scaled[mid] < base[mid]) and torch.all(scaled[mid] > base[mid] / 8.0)


def test_llama3_rope_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf_config = LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=131072,
                            rope_parameters=params)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = rope_inverse_frequencies(128, ModelConfig.from_dict({**BASE, "rope_parameters": params}).rope)
    torch.testing.assert_close(ours, expected.float())


def test_head_dim_and_eos_ids():
    config = ModelConfig.from_dict({**BASE, "head_dim": 32, "eos_token_id": [2, 7]})
    assert (config.head_dim, config.q_size, config.kv_size) == (32, 128, 64)
    assert config.eos_token_ids == (2, 7)


def test_end_of_sequence_ids_join_generation_config_and_the_tokenizers_eos(tmp_path):
    """Chat checkpoints name their end of turn in generation_config.json (Llama 3's <|eot_id|>)
    or as the tokenizer's eos_token, beside config.json's: the engine stops on all of them, as
    transformers' generate and the gateway's tokenizer do."""
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 2}))
    assert ModelConfig.from_model_dir(tmp_path).eos_token_ids == (2,)  # nothing more to read
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|eot|>"}}))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 11, "content": "<|eot|>"}],
                                                         "model": {"vocab": {"a": 3}}}))
    assert ModelConfig.from_model_dir(tmp_path).eos_token_ids == (2, 9, 11)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "a"}))  # a plain vocabulary entry
    (tmp_path / "generation_config.json").write_text("not json")  # unreadable: ignored, as a missing one
    assert ModelConfig.from_model_dir(tmp_path).eos_token_ids == (2, 3)
