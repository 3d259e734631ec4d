"""Shared fixtures: tiny random checkpoints written with transformers' own config classes."""
from __future__ import annotations

import pytest
import torch

ARCHITECTURES = ("llama", "qwen2", "qwen3")


def make_checkpoint(path, arch: str = "llama", seed: int = 0, **overrides):
    """Write a tiny random Hugging Face checkpoint of `arch` into `path`; return path."""
    import transformers

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    common.update(overrides)
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        model_cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common)
        model_cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        common.setdefault("head_dim", 16)
        common.setdefault("tie_word_embeddings", True)  # as the small Qwen3 releases are
        config = transformers.Qwen3Config(**common)
        model_cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = model_cls(config)
    # Random init leaves biases at zero; make them matter so a mapping bug shows.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """One tiny checkpoint per supported architecture, built once per test session."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: make_checkpoint(root / arch, arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def served_checkpoint(tmp_path_factory):
    """A tiny llama checkpoint with a tokenizer beside it: what a cluster test serves."""
    from cluster_harness import SERVED_MAX_POSITIONS
    from tokenizer_fixture import make_tokenizer
    path = make_checkpoint(tmp_path_factory.mktemp("served") / "llama", "llama", vocab_size=320,
                           max_position_embeddings=SERVED_MAX_POSITIONS)
    make_tokenizer(path, vocab_size=320)
    return path


@pytest.fixture(scope="session")
def llama_dir(checkpoints):
    return checkpoints["llama"]


@pytest.fixture(scope="session")
def tokenizer(served_checkpoint):
    """The gateway's tokenizer over the served checkpoint (test_default_model has its own)."""
    from gateway.tokenizer import Tokenizer
    return Tokenizer(served_checkpoint)


@pytest.fixture(scope="module")
def single_torch_thread():
    """One intra-op thread for a module of tiny tensors: on a loaded box each multi-threaded op
    otherwise waits milliseconds for a descheduled thread. Restored afterwards."""
    import torch
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session", autouse=True)
def no_cluster_process_outlives_the_tests():
    """Every process a test's cluster starts is stopped by it. One still running when the tests
    end is a leak: it is killed, and the run fails naming it."""
    yield
    import psutil
    from bench.cluster_process import leftover_processes
    left = leftover_processes()
    named = [" ".join(p.info["cmdline"] or [])[:200] for p in left]
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    assert not left, f"processes left running by the tests: {named}"

