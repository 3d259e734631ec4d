"""gateway.client's command line: which subcommand an argv runs, and with which arguments."""
from __future__ import annotations

import pytest

from gateway import client


@pytest.fixture
def calls(monkeypatch):
    seen = []
    for name in ("status", "probe", "generate"):
        monkeypatch.setattr(client, name, lambda args, name=name: seen.append((name, args)) or 0)
    return seen


@pytest.mark.parametrize("argv", [
    ["status", "--address", "127.0.0.1:1"],
    ["--address", "127.0.0.1:1", "status"],
    ["--address=127.0.0.1:1", "--timeout", "3", "status"],
])
def test_status_runs_whether_it_comes_before_or_after_the_connection_options(calls, argv):
    assert client.main(argv) == 0
    [(name, args)] = calls
    assert name == "status" and args.address == "127.0.0.1:1"


def test_probe_after_the_connection_options_keeps_its_own_arguments(calls):
    assert client.main(["--address", "127.0.0.1:1", "probe", "worker-3", "--deep"]) == 0
    [(name, args)] = calls
    assert (name, args.worker_id, args.deep, args.address) == ("probe", "worker-3", True, "127.0.0.1:1")


@pytest.mark.parametrize("argv", [
    ["status report", "--address", "127.0.0.1:1"],  # a prompt that merely starts with the word
    ["--max-tokens", "4", "status"],  # after a generation option, "status" is the prompt
    ["--address", "127.0.0.1:1", "--", "status"],
])
def test_a_prompt_is_never_taken_for_a_subcommand(calls, argv):
    assert client.main(argv) == 0
    [(name, args)] = calls
    assert name == "generate" and args.prompt in ("status report", "status")


@pytest.mark.parametrize("flag, value", [
    ("--seed", "-1"), ("--logprobs", "-1"), ("--priority", "99999999999"), ("--max-tokens", "3000000000"),
    ("--top-k", "3000000000"), ("--speculative-ngram-k", "-1"), ("--prompt-logprobs", "-1"),
])
def test_a_value_its_proto_field_cannot_hold_is_a_usage_error_naming_the_flag(calls, capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        client.main(["hi", flag, value])
    assert e.value.code == 2 and not calls
    err = capsys.readouterr().err
    assert f"argument {flag}: {value} is outside" in err and "Traceback" not in err


def test_values_at_the_fields_bounds_build_a_request(calls):
    assert client.main(["hi", "--seed", str(2**64 - 1), "--priority", str(-2**31), "--logprobs", "20",
                        "--prompt-logprobs", "0"]) == 0
    [(name, args)] = calls
    request = client.build_request(args)
    assert (request.sampling.seed, request.priority, request.sampling.logprobs) == (2**64 - 1, -2**31, 20)
    assert request.sampling.HasField("prompt_logprobs") and request.sampling.prompt_logprobs == 0


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_timeout_must_be_a_positive_finite_number_of_seconds(calls, capsys, value):
    with pytest.raises(SystemExit) as e:
        client.main(["hi", "--timeout", value])
    assert e.value.code == 2 and not calls and "argument --timeout" in capsys.readouterr().err


def test_an_unreadable_tls_file_is_an_error_naming_the_flag(tmp_path):
    with pytest.raises(SystemExit) as e:
        client.main(["hi", "--tls-ca", str(tmp_path / "missing.pem")])
    assert str(e.value).startswith("--tls-ca: cannot read") and "missing.pem" in str(e.value)


def test_status_prints_why_a_worker_exited():
    from protos import inference_pb2
    cluster = inference_pb2.ClusterStatus(workers=[
        inference_pb2.WorkerStatus(worker_id="worker-0", alive=True, ready=True, last_heartbeat_age_s=0.1),
        inference_pb2.WorkerStatus(worker_id="worker-1", last_heartbeat_age_s=1e9,
                                   exit_reason="cannot load the model in m: UnsupportedModelError: x")])
    lines = client.format_status(cluster).splitlines()
    assert lines[-2] == "worker-1 exited: cannot load the model in m: UnsupportedModelError: x"
    assert not any("worker-0 exited" in line for line in lines)
    assert "never" in next(line for line in lines if line.startswith("worker-1 "))
