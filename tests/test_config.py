"""Cluster config: TOML loading, flag overrides for every value, and errors that name the key."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from shared.config import ClusterConfig, ConfigError, add_config_flags, config_from_args, load_config
from worker.service import engine_config

ROOT = Path(__file__).resolve().parent.parent


def parse(argv):
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return config_from_args(parser.parse_args(argv))


def test_the_shipped_config_loads_and_is_frozen():
    config = load_config(ROOT / "configs" / "default.toml")
    assert config.num_workers == 2 and config.gateway.port == 50051
    assert config.queues.bucket_bounds == (128, 512, 2048)
    assert config.queues.max_wait_for(-1) == 2.0 and config.queues.max_wait_for(0) is None
    with pytest.raises(AttributeError):
        config.gateway.port = 1  # frozen


def test_every_value_has_a_flag_and_flags_override_the_file():
    config = parse(["--config", str(ROOT / "configs" / "default.toml"), "--gateway.port", "6000",
                    "--queues.bucket_bounds", "[64, 256]", "--worker.enable_prefix_caching", "false",
                    "--model-dir", "/models/x", "--queues.policy", "fifo", "--num_workers", "3"])
    assert config.gateway.port == 6000 and config.queues.bucket_bounds == (64, 256)
    assert config.worker.enable_prefix_caching is False and config.model_dir == "/models/x"
    assert config.queues.policy == "fifo" and config.worker_ids == ["worker-0", "worker-1", "worker-2"]
    quantized = parse(["--worker.quantization", "mixed", "--worker.quantization_rule", "params>=1e6:int8,*:int4",
                       "--worker.quantization_calibration", "none"])
    engine = engine_config(quantized)
    assert engine.quantization_rule == "params>=1e6:int8,*:int4"
    assert engine.quantization_calibration == "none" and engine.quantization == "mixed"
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    flags = {a.dest for a in parser._actions}
    for section in ("gateway", "queues", "worker"):
        for name in getattr(ClusterConfig(), section).__dataclass_fields__:
            assert f"cfg:{section}.{name}" in flags


@pytest.mark.parametrize("overrides, words", [
    ({"gateway.port": 70000}, "gateway.port"),
    ({"gateway.portt": 1}, "unknown config keys ['gateway.portt']"),
    ({"queues.bucket_bounds": [512, 128]}, "strictly increasing"),
    ({"worker.max_num_seqs": 0}, "worker.max_num_seqs"),
    ({"worker.max_num_seqs": "many"}, "must be an integer"),
    ({"queues.policy": "lifo"}, "queues.policy"),
    ({"queues.max_queue_wait_s": [[0, -1.0]]}, "queues.max_queue_wait_s"),
    ({"num_workers": -1}, "num_workers"),
    ({"gateway.stream_interval": 0}, "gateway.stream_interval"),
    ({"gateway.stream_hold_ms": 0}, "gateway.stream_hold_ms"),
    ({"worker.quantization_calibration": "/no/such/calibration.txt"}, "worker.quantization_calibration"),
    ({"gateway.heartbeat_timeout_s": float("inf")}, "gateway.heartbeat_timeout_s must be a finite number"),
    ({"worker.memory_high_fraction": float("nan")}, "worker.memory_high_fraction must be a finite number"),
    ({"worker.heartbeat_interval_s": 0.8}, "worker.heartbeat_interval_s must be at most half of gateway.heartbeat"),
])
def test_bad_values_are_refused_by_name(overrides, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, overrides)


def test_unreadable_file_is_a_config_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("port = = 3")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(bad)


def test_cpu_threads_are_split_between_workers_after_the_gateways_core(monkeypatch):
    monkeypatch.setattr("shared.config.usable_cores", lambda: list(range(8)))
    assert load_config(None, {"num_workers": 2}).worker_threads() == 3  # (8 - 1) // 2
    assert load_config(None, {"num_workers": 1}).worker_threads() == 7
    assert load_config(None, {"num_workers": 2, "worker.reserved_cores": 0}).worker_threads() == 4
    assert load_config(None, {"num_workers": 16}).worker_threads() == 1
    assert load_config(None, {"worker.num_threads": 3}).worker_threads() == 3
    with pytest.raises(ConfigError, match="worker.reserved_cores"):
        load_config(None, {"worker.reserved_cores": -2})


def test_hosts_below_eight_cores_keep_no_core_from_the_workers_unless_told(monkeypatch):
    monkeypatch.setattr("shared.config.usable_cores", lambda: [0, 1])  # this 2-core host
    assert load_config(None, {"num_workers": 1}).reserved_cores() == 0
    assert load_config(None, {"num_workers": 1}).worker_threads() == 2
    assert load_config(None, {"num_workers": 2}).worker_threads() == 1
    assert load_config(None, {"num_workers": 1, "worker.reserved_cores": 1}).worker_threads() == 1
    monkeypatch.setattr("shared.config.usable_cores", lambda: list(range(7)))
    assert load_config(None, {"num_workers": 1}).worker_threads() == 7
    monkeypatch.setattr("shared.config.usable_cores", lambda: list(range(8)))
    assert load_config(None, {"num_workers": 1}).reserved_cores() == 1


def test_usable_cores_follow_the_affinity_mask(monkeypatch):
    from shared import config as config_module
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no affinity masks on this platform")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5, 0, 3})
    assert config_module.usable_cores() == [0, 3, 5]
