"""One definition per engine setting: the `[worker]` TOML keys reach the engine and its parts with
their values, and the offline `Engine.from_model_dir` takes the same names, checked the same way."""
from __future__ import annotations

import tomllib
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from shared.config import ClusterConfig, ConfigError, WorkerConfig, load_config
from shared.engine_config import EngineConfig
from worker.engine import Engine
from worker.service import engine_config

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TOML = ROOT / "configs" / "default.toml"
ENGINE_NAMES = {f.name for f in fields(EngineConfig)}
# The worker process's own settings: they configure the loop, heartbeats, watchdog and supervisor.
SERVICE_NAMES = {f.name for f in fields(WorkerConfig)} - ENGINE_NAMES


def _worker_section() -> dict:
    return tomllib.loads(DEFAULT_TOML.read_text())["worker"]


def test_the_worker_section_is_the_engine_config_plus_the_process_settings():
    assert issubclass(WorkerConfig, EngineConfig)
    assert set(_worker_section()) <= ENGINE_NAMES | SERVICE_NAMES
    assert not ENGINE_NAMES & SERVICE_NAMES
    # The defaults are defined once: a bare engine and a bare worker section agree on every engine key.
    bare_worker, bare_engine = WorkerConfig(), EngineConfig()
    assert {n: getattr(bare_worker, n) for n in ENGINE_NAMES} == {n: getattr(bare_engine, n) for n in ENGINE_NAMES}


def test_every_key_of_the_default_toml_reaches_the_engine_with_its_value(checkpoints, monkeypatch):
    monkeypatch.setattr("shared.config.usable_cores", lambda: [0, 1, 2])
    section = _worker_section()
    # A small pool keeps the test light; it is one more key that must arrive as given.
    config = load_config(DEFAULT_TOML, {"model_dir": str(checkpoints["llama"]), "worker.num_kv_blocks": 48,
                                        "worker.max_num_seqs": 5, "worker.block_size": 8})
    built = engine_config(config)
    for name, value in section.items():
        if name in ENGINE_NAMES and name not in ("num_kv_blocks", "max_num_seqs", "block_size", "num_threads"):
            assert getattr(built, name) == (tuple(value) if isinstance(value, list) else value), name
    assert built.num_threads == config.worker_threads() == (3 - config.reserved_cores()) // config.num_workers
    engine = Engine.from_model_dir(config.model_dir, built)
    assert engine.config == built
    # ... and the parts read them.
    assert engine.block_manager.num_blocks == 48 and engine.block_manager.block_size == 8
    assert engine.block_manager.enable_prefix_caching == section.get("enable_prefix_caching", True)
    assert engine.scheduler.config.max_num_seqs == 5
    assert engine.scheduler.config.max_num_batched_tokens == section["max_num_batched_tokens"]
    assert engine.runner.block_size == 8 and engine.runner.max_num_seqs == 5
    assert engine.runner.max_num_tokens == section["max_num_batched_tokens"]
    assert engine.placement_plan.load_mode == section["load_mode"]
    assert engine.quantization_report is None and section["quantization"] == "none"
    assert section["kv_cache_dtype"] == "" and engine.kv_caches[0][0].dtype == torch.float32  # the model's


def test_from_model_dir_takes_the_toml_names_and_checks_them_the_same_way(checkpoints):
    engine = Engine.from_model_dir(checkpoints["llama"], num_kv_blocks=16, block_size=4, max_model_len=64,
                                   max_prefill_chunk_tokens=8)
    assert engine.config == EngineConfig(num_kv_blocks=16, block_size=4, max_model_len=64, max_prefill_chunk_tokens=8)
    assert engine.max_model_len == 64 and engine.scheduler.config.max_prefill_chunk_tokens == 8
    # The same conversion as TOML: a list for a tuple, an int for a float; the same refusals.
    for bad, words in [(dict(max_num_seqs="many"), "must be an integer"),
                       (dict(block_size=0), "block_size must be >= 1"),
                       (dict(quantization="int3"), "quantization must be"),
                       (dict(kv_cache_dtype="fp8"), "kv_cache_dtype must be"),
                       (dict(quantization="mixed", quantization_rule="attention:int9"), "quantization_rule"),
                       # Beside another preset a rule would do nothing: refused, not ignored.
                       (dict(quantization="int8", quantization_rule="attention:int4"),
                        'quantization_rule must be empty unless quantization = "mixed"'),
                       (dict(quantization_rule="garbage"), "quantization_rule must be empty unless"),
                       (dict(load_mode="sharded", devices=["cpu"]), "at least 2 devices")]:
        with pytest.raises(ConfigError, match=words):
            Engine.from_model_dir(checkpoints["llama"], **bad)
        toml_key = {f"worker.{k}": v for k, v in bad.items()}
        with pytest.raises(ConfigError, match=f"worker.*{words}"):
            load_config(None, toml_key)
    with pytest.raises(TypeError, match="unknown engine options"):
        Engine.from_model_dir(checkpoints["llama"], heartbeat_interval_s=1.0)  # a process setting, not the engine's


def test_settings_this_model_refuses_are_config_errors_naming_the_key(checkpoints, monkeypatch):
    """Every start would refuse them again: a ConfigError (its worker exits EXIT_DO_NOT_RESTART), raised
    before any weight is read."""
    monkeypatch.setattr("worker.engine_builder.load_model", lambda *a, **k: pytest.fail("weights read"))
    folder = checkpoints["llama"]
    for settings, words in [(dict(max_model_len=100_000), "max_model_len 100000 exceeds the model's "
                                                          "max_position_embeddings 512"),
                            (dict(quantization_activations="int8"), "quantization_activations 'int8' needs "
                                                                    "quantized layers: set quantization")]:
        with pytest.raises(ConfigError, match=words):
            Engine.from_model_dir(folder, device="cpu", **settings)


def test_every_engine_name_is_a_worker_toml_key():
    flags = set(ClusterConfig().worker.__dataclass_fields__)
    assert ENGINE_NAMES <= flags
    for name in ENGINE_NAMES:
        value = getattr(EngineConfig(), name)
        if value is None:
            continue
        assert getattr(load_config(None, {f"worker.{name}": list(value) if isinstance(value, tuple) else value})
                       .worker, name) == value
