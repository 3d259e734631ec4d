"""A model, tokenizer or setting that can never load: the process says why and exits EXIT_DO_NOT_RESTART,
which its supervisor does not restart (a restart loop would load the model again and again and
show nothing). A worker tells the gateway first, so the status RPC names the reason, and the
cluster's other workers keep serving."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bench.cluster_process import _signal_group, free_port
from cluster_harness import ROOT, Cluster, generate, write_config
from shared.supervisor import EXIT_DO_NOT_RESTART, Supervisor

pytestmark = pytest.mark.timeout(300)
EXIT_BOUND_S = 120.0  # start -> the supervisor's exit: one torch import and a config read


def test_the_supervisor_does_not_restart_a_child_that_exits_do_not_restart(tmp_path):
    marker = tmp_path / "starts"
    child = [sys.executable, "-c", f"open({str(marker)!r}, 'a').write('x'); raise SystemExit({EXIT_DO_NOT_RESTART})"]
    supervisor = Supervisor("child", child, backoff_s=0.01, max_backoff_s=0.01)
    thread = threading.Thread(target=lambda: setattr(supervisor, "result", supervisor.run()), daemon=True)
    thread.start()
    thread.join(timeout=30)
    if thread.is_alive():
        supervisor.stop()
        thread.join(timeout=20)
        pytest.fail(f"the supervisor kept restarting its child: {marker.read_text()!r}")
    assert supervisor.result == EXIT_DO_NOT_RESTART and marker.read_text() == "x"


def _run_until_exit(argv: list[str], log: Path) -> int:
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=EXIT_BOUND_S)
        finally:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=10)


def _moe_copy(checkpoint: Path, tmp_path: Path) -> tuple[Path, list[str]]:
    moe = tmp_path / "moe"
    shutil.copytree(checkpoint, moe)
    config = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**config, "num_local_experts": 8}))
    return moe, []


def _empty_calibration_text(checkpoint: Path, tmp_path: Path) -> tuple[Path, list[str]]:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    return checkpoint, ["--worker.quantization", "int8", "--worker.quantization_calibration", str(empty)]


# What makes every start fail the same way -> (the model folder and flags, the fault as the worker names it).
CANNOT_LOAD = {
    "a checkpoint it refuses": (_moe_copy, "UnsupportedModelError: mixture of experts (num_local_experts=8) is not "
                                           "supported"),
    "a setting the model refuses": (lambda checkpoint, _: (checkpoint, ["--worker.max_model_len", "100000"]),
                                    "ConfigError: max_model_len 100000 exceeds the model's max_position_embeddings"),
    "a calibration text file it cannot use": (_empty_calibration_text, "ConfigError: quantization_calibration "
                                              "{tmp_path}/empty.txt holds fewer than 2 tokens"),
}


@pytest.fixture(scope="module")
def cluster(served_checkpoint):
    """One cluster for every case: each bad worker joins it under an id of its own."""
    with Cluster(served_checkpoint, num_workers=1) as c:
        yield c


@pytest.mark.parametrize("case", CANNOT_LOAD)
def test_a_worker_whose_model_cannot_load_tells_the_gateway_and_is_not_restarted(served_checkpoint, cluster, tmp_path,
                                                                                 case):
    make, fault = CANNOT_LOAD[case]
    model_dir, flags = make(served_checkpoint, tmp_path)
    fault = fault.format(tmp_path=tmp_path)
    worker_id = f"worker-bad-{list(CANNOT_LOAD).index(case)}"
    log = tmp_path / f"{worker_id}.log"
    rc = _run_until_exit([sys.executable, "-m", "worker.supervisor", "--config", str(cluster.config_path),
                          "--worker-id", worker_id, "--model-dir", str(model_dir), *flags], log)
    text = log.read_text()
    assert rc == EXIT_DO_NOT_RESTART, text
    assert text.count("started model process") == 1, text
    # One line names the fault; a traceback would only bury it.
    assert f"{worker_id} cannot load the model in {model_dir}: {fault}" in text and "Traceback" not in text, text
    [entry] = [w for w in cluster.status().workers if w.worker_id == worker_id]
    assert not entry.alive
    assert entry.exit_reason.startswith(f"cannot load the model in {model_dir}: {fault}"), entry.exit_reason
    ids, _, _ = generate(cluster.stub, prompt_token_ids=[5, 6, 7], sampling=dict(max_tokens=4, ignore_eos=True))
    assert len(ids) == 4


def test_a_worker_answers_a_bad_config_value_as_the_gateway_does(capsys):
    """Exit 2 with argparse's line naming the key, before anything loads; no traceback."""
    from worker.__main__ import main
    with pytest.raises(SystemExit) as exit_:
        main(["--worker-id", "w", "--worker.max_num_seqs", "0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines() == ["python -m worker: error: worker.max_num_seqs must be >= 1, got 0"], err


def test_a_gateway_without_a_tokenizer_is_not_restarted(served_checkpoint, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(served_checkpoint, bare)
    (bare / "tokenizer.json").unlink()
    config = write_config(tmp_path / "cluster.toml", bare, tmp_path / "run", free_port(), num_workers=1)
    log = tmp_path / "gateway.log"
    rc = _run_until_exit([sys.executable, "-m", "gateway", "--supervise", "--config", str(config)], log)
    text = log.read_text()
    assert rc == EXIT_DO_NOT_RESTART, text
    assert text.count("started gateway") == 1, text
    assert f"{bare} has no tokenizer.json" in text


@pytest.mark.parametrize("code, restarted", [(EXIT_DO_NOT_RESTART, False), (1, True)])
def test_a_ray_actor_is_restarted_after_a_crash_but_not_after_do_not_restart(tmp_path, monkeypatch, code, restarted):
    from deploy.ray import process
    monkeypatch.setattr(process, "CRASH_LOOP_DELAY_S", 0.0)
    exited = threading.Event()
    child = process.ChildProcess([sys.executable, "-c", f"raise SystemExit({code})"], tmp_path / "child.log", ROOT,
                                 on_exit=exited.set)
    child._thread.join(timeout=30)
    assert not child._thread.is_alive() and child.proc.returncode == code
    assert exited.is_set() == restarted


def test_a_model_dir_that_does_not_exist_is_named_as_such(tmp_path):
    from gateway.tokenizer import Tokenizer, TokenizerError
    from worker.model.config import CheckpointError, ModelConfig
    missing = tmp_path / "nowhere"
    with pytest.raises(TokenizerError, match=f"the model folder {missing} \\(model_dir\\) does not exist"):
        Tokenizer(missing)
    with pytest.raises(CheckpointError, match=f"the model folder {missing} \\(model_dir\\) does not exist"):
        ModelConfig.from_model_dir(missing)


def test_a_cluster_started_twice_refuses_rather_than_leak_its_first_processes(served_checkpoint):
    with Cluster(served_checkpoint, num_workers=1) as cluster:
        with pytest.raises(RuntimeError, match="already running"):
            cluster.start()
        pids = [p.pid for p in cluster.procs.values()]
    assert all(p.poll() is not None for p in cluster.procs.values()), pids
