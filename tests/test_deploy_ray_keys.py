"""deploy/ray/keys.py: only public certificates are admitted, under a worker id that names a file
of its own, and a worker pair made in a dir lets that worker join the gateway whose dir admitted it
(the same zmq.auth files shared/curve.py loads)."""
from __future__ import annotations

import stat

import pytest
import zmq.auth

from deploy.ray import keys
from shared.curve import load_client_keys, load_server_keys, public_file, secret_file


def test_an_admitted_worker_key_is_in_the_gateways_allowed_set(tmp_path):
    gateway_dir, worker_dir = tmp_path / "gw", tmp_path / "w"
    keys.make_pair(gateway_dir, "gateway")
    public_text = keys.new_worker_pair(worker_dir)
    keys.admit(gateway_dir, "worker-3", public_text)
    keys.write_gateway_public(worker_dir, public_file(gateway_dir, "gateway").read_text())

    worker_public, _ = zmq.auth.load_certificate(public_file(worker_dir, "worker"))
    server = load_server_keys(gateway_dir)
    assert worker_public in server.allowed.keys
    client = load_client_keys(worker_dir)
    assert client.server_public == server.public
    assert stat.S_IMODE(secret_file(worker_dir, "worker").stat().st_mode) == 0o600
    assert stat.S_IMODE(gateway_dir.stat().st_mode) == 0o700

    keys.revoke(gateway_dir, "worker-3")
    assert worker_public not in load_server_keys(gateway_dir).allowed.keys


def test_a_restarted_worker_gets_a_fresh_pair_and_the_gateway_keeps_its_own(tmp_path):
    keys.make_pair(tmp_path / "gw", "gateway")
    before = public_file(tmp_path / "gw", "gateway").read_text()
    keys.make_pair(tmp_path / "gw", "gateway")  # the gateway actor restarted: same pair
    assert public_file(tmp_path / "gw", "gateway").read_text() == before
    first = keys.new_worker_pair(tmp_path / "w")
    assert keys.new_worker_pair(tmp_path / "w") != first


@pytest.mark.parametrize("worker_id", ["gateway", "../escape", "", "a/b", ".hidden"])
def test_worker_ids_that_would_not_name_a_key_file_of_their_own_are_refused(tmp_path, worker_id):
    keys.make_pair(tmp_path / "gw", "gateway")
    public_text = keys.new_worker_pair(tmp_path / "w")
    with pytest.raises(ValueError, match="cannot name a key file"):
        keys.admit(tmp_path / "gw", worker_id, public_text)


def test_only_a_public_certificate_is_admitted(tmp_path):
    gateway_dir = tmp_path / "gw"
    keys.make_pair(gateway_dir, "gateway")
    keys.new_worker_pair(tmp_path / "w")
    with pytest.raises(ValueError, match="secret"):
        keys.admit(gateway_dir, "worker-0", secret_file(tmp_path / "w", "worker").read_text())
    with pytest.raises(ValueError):
        keys.admit(gateway_dir, "worker-0", "not a certificate")
    assert not public_file(gateway_dir, "worker-0").exists()
    assert sorted(p.name for p in gateway_dir.iterdir()) == ["gateway.key", "gateway.key_secret"]  # no temp left
