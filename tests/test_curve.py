"""Who may join as a worker, by key and by policy: CURVE keys on disk (shared/curve.py, tools/curve_keys.py),
made once by concurrent creators, private, reloaded without a restart; and which endpoints need them."""
from __future__ import annotations

import logging
import subprocess
import sys
import threading

import pytest
import zmq
import zmq.auth

from cluster_harness import ROOT, free_port
from curve_harness import config_for, mode_of, short_temp_dir
from shared.config import ConfigError
from shared.curve import (GATEWAY, WORKER, AllowedKeys, RefusalLog, cluster_keys_dir, create_keys_dir,
                          key_files, load_client_keys, load_server_keys, public_file, secret_file, transport_keys,
                          write_keys)
from shared.ipc import bind_gateway_socket, connect_worker_socket
from tools import curve_keys


@pytest.fixture
def short_dir():
    yield from short_temp_dir()


# ---- keys on disk -------------------------------------------------------------------------------------
def test_concurrent_creators_make_one_keys_dir_and_all_use_it(short_dir):
    path = short_dir / "run" / "keys"
    barrier = threading.Barrier(8)
    results, errors = [], []

    def create():
        try:
            barrier.wait(timeout=10)
            made = create_keys_dir(path)
            results.append((made, load_client_keys(made)))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and len(results) == 8
    # Every creator ended with the winner's keys; the losers' temporary dirs are gone.
    assert {made for made, _ in results} == {path}
    assert {keys for _, keys in results} == {load_client_keys(path)}
    assert sorted(p.name for p in path.parent.iterdir()) == ["keys"]
    assert sorted(p.name for p in path.iterdir()) == sorted(f.name for f in key_files(path))


def test_concurrent_processes_share_the_cluster_keys(short_dir):
    """Gateway and workers start at once and each calls cluster_keys_dir: one set of keys wins."""
    code = ("import sys; from shared.config import load_config; from shared.curve import cluster_keys_dir, "
            "load_client_keys; c = load_config(None, {'run_dir': sys.argv[1]}); "
            "print(load_client_keys(cluster_keys_dir(c, sys.argv[2])).public.decode())")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(short_dir), role], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for role in (GATEWAY, WORKER, WORKER, WORKER)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            outs.append(out.strip())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert len(set(outs)) == 1
    assert outs[0] == load_client_keys(short_dir / "keys").public.decode()


def test_the_cluster_keys_dir_is_private(short_dir):
    keys_dir = cluster_keys_dir(config_for(short_dir / "run"), GATEWAY)
    assert keys_dir == (short_dir / "run" / "keys").resolve()
    assert mode_of(keys_dir) == 0o700
    for name in (GATEWAY, WORKER):
        assert mode_of(secret_file(keys_dir, name)) == 0o600
    # A worker of the same cluster finds the same dir, and the pairs fit together.
    assert cluster_keys_dir(config_for(short_dir / "run"), WORKER) == keys_dir
    server, client = load_server_keys(keys_dir), load_client_keys(keys_dir)
    assert client.server_public == server.public and client.public in server.allowed.keys
    assert server.public not in server.allowed.keys  # its own key is not a worker's


def test_tool_writes_loadable_certificates_and_refuses_to_overwrite(short_dir, capsys):
    keys_dir = short_dir / "k"
    assert curve_keys.main([str(keys_dir)]) == 0
    assert capsys.readouterr().out.split() == [str(f) for f in key_files(keys_dir)]
    assert mode_of(keys_dir) == 0o700
    pairs = {}
    for name in (GATEWAY, WORKER):
        public, secret = zmq.auth.load_certificate(public_file(keys_dir, name))
        assert secret is None and len(public) == 40  # z85 of 32 bytes
        public2, secret2 = zmq.auth.load_certificate(secret_file(keys_dir, name))
        assert public2 == public and len(secret2) == 40
        assert mode_of(secret_file(keys_dir, name)) == 0o600
        assert zmq.curve_public(secret2) == public  # a real pair
        pairs[name] = public
    assert pairs[GATEWAY] != pairs[WORKER]
    before = {f: f.read_bytes() for f in key_files(keys_dir)}
    assert curve_keys.main([str(keys_dir)]) == 1
    assert "--force" in capsys.readouterr().err
    assert {f: f.read_bytes() for f in key_files(keys_dir)} == before
    assert curve_keys.main([str(keys_dir), "--force"]) == 0
    assert zmq.auth.load_certificate(public_file(keys_dir, GATEWAY))[0] != pairs[GATEWAY]
    assert sorted(p.name for p in keys_dir.iterdir()) == sorted(f.name for f in key_files(keys_dir))


def test_tool_refuses_even_one_existing_file(short_dir):
    keys_dir = short_dir / "k"
    keys_dir.mkdir()
    public_file(keys_dir, WORKER).write_text("someone's key")
    with pytest.raises(FileExistsError, match="worker.key"):
        write_keys(keys_dir)
    assert sorted(p.name for p in keys_dir.iterdir()) == ["worker.key"]


def _public_certificate(public: bytes) -> str:
    return f'metadata\ncurve\n    public-key = "{public.decode()}"\n'


def test_allowed_keys_follow_the_dir_without_a_restart(short_dir, caplog):
    write_keys(short_dir)
    now = [100.0]
    allowed = AllowedKeys(short_dir, clock=lambda: now[0])
    worker_public = load_client_keys(short_dir).public
    assert allowed.keys == {worker_public}
    public, _secret = zmq.curve_keypair()
    assert not allowed.callback("*", public)
    # A key file added (the dir's mtime moves) is admitted at the next handshake.
    (short_dir / "late.key").write_text(_public_certificate(public))
    (short_dir / "junk.key").write_text("not a certificate\n")
    assert allowed.callback("*", public)
    assert any("junk.key" in r.getMessage() for r in caplog.records)
    reloads = allowed.num_reloads
    assert allowed.callback("*", worker_public) and allowed.num_reloads == reloads  # nothing changed: no re-read
    # A key file removed is refused from the next handshake on.
    (short_dir / "late.key").unlink()
    assert not allowed.callback("*", public)


def test_an_unknown_key_rereads_the_dir_at_most_once_a_second(short_dir):
    """A file rewritten in place leaves the dir's mtime alone: an unknown key re-reads it, rate-limited."""
    write_keys(short_dir)
    now = [100.0]
    (short_dir / "spare.key").write_text("to be filled in\n")
    allowed = AllowedKeys(short_dir, clock=lambda: now[0])
    public, _secret = zmq.curve_keypair()
    now[0] += 0.5
    mtime_ns = short_dir.stat().st_mtime_ns
    with open(short_dir / "spare.key", "w") as f:  # in place: the dir's mtime does not move
        f.write(_public_certificate(public))
    assert short_dir.stat().st_mtime_ns == mtime_ns
    reloads = allowed.num_reloads
    assert not allowed.callback("*", public)  # within a second of the last read: not re-read
    assert allowed.num_reloads == reloads
    now[0] += 0.6
    assert allowed.callback("*", public)  # re-read: admitted
    assert allowed.num_reloads == reloads + 1
    for _ in range(5):  # random keys cannot make it read more than once a second
        assert not allowed.callback("*", zmq.curve_keypair()[0])
    assert allowed.num_reloads == reloads + 1


def test_refusals_are_logged_once_per_interval_per_key(caplog):
    now = [0.0]
    refusals = RefusalLog(interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING):
        assert refusals.warn("k1", "refused %s", "k1")
        assert not refusals.warn("k1", "refused %s", "k1")
        assert refusals.warn("k2", "refused %s", "k2")
        now[0] = 11.0
        assert refusals.warn("k1", "refused %s", "k1")
    assert [r.getMessage() for r in caplog.records] == ["refused k1", "refused k2", "refused k1 (1 more since)"]


# ---- the policy ---------------------------------------------------------------------------------------
def test_ipc_and_loopback_tcp_use_the_cluster_keys(short_dir):
    for endpoint in ("", f"tcp://127.0.0.1:{free_port()}", f"tcp://localhost:{free_port()}"):
        config = config_for(short_dir, endpoint)
        server, client = transport_keys(config, GATEWAY), transport_keys(config, WORKER)
        assert server.keys_dir == client.keys_dir == (short_dir / "keys").resolve()
        assert client.server_public == server.public


def test_tcp_reachable_from_other_hosts_needs_keys_or_allow_insecure_tcp(short_dir, caplog):
    endpoint = f"tcp://0.0.0.0:{free_port()}"
    for role in (GATEWAY, WORKER):
        with pytest.raises(ConfigError, match="gateway.allow_insecure_tcp"):
            transport_keys(config_for(short_dir, endpoint), role)
    with pytest.raises(ConfigError, match="allow_insecure_tcp"):
        bind_gateway_socket(config_for(short_dir, endpoint))  # refused before any socket is made
    with pytest.raises(ConfigError, match="allow_insecure_tcp"):
        connect_worker_socket(config_for(short_dir, "tcp://192.0.2.1:5555"), "worker-0", "inc")
    assert not (short_dir / "keys").exists()
    insecure = config_for(short_dir, endpoint, **{"gateway.allow_insecure_tcp": True})
    with caplog.at_level(logging.WARNING):
        assert transport_keys(insecure, GATEWAY) is None and transport_keys(insecure, WORKER) is None
    assert sum("WITHOUT authentication" in r.getMessage() for r in caplog.records) == 2
    # With keys dirs it is CURVE, with those keys.
    write_keys(short_dir / "k")
    keyed = config_for(short_dir, endpoint, **{"gateway.curve_keys_dir": str(short_dir / "k"),
                                               "worker.curve_keys_dir": str(short_dir / "k")})
    assert transport_keys(keyed, GATEWAY).keys_dir == transport_keys(keyed, WORKER).keys_dir == short_dir / "k"


def test_a_configured_keys_dir_must_exist_and_hold_the_keys(short_dir):
    missing = config_for(short_dir, **{"worker.curve_keys_dir": str(short_dir / "nope")})
    with pytest.raises(ConfigError, match="tools.curve_keys"):
        transport_keys(missing, WORKER)
    (short_dir / "empty").mkdir()
    empty = config_for(short_dir, **{"gateway.curve_keys_dir": str(short_dir / "empty")})
    with pytest.raises(ConfigError, match="gateway.key_secret"):
        transport_keys(empty, GATEWAY)

