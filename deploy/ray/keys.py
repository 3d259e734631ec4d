"""CURVE keys on Ray: every actor makes its own pair on its own node, and only public keys travel.

The gateway actor makes the gateway pair once and keeps it across its restarts. A worker actor
makes a fresh pair each time it starts and hands its public key to the gateway actor, which writes
it as `<worker id>.key` into the gateway's keys dir (the gateway re-reads that dir when an unknown
key knocks, so no restart) and answers with the gateway's public key. No secret key ever leaves
the node it was made on. Files are zmq.auth certificates, as `tools/curve_keys.py` writes them.
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import zmq.auth

from shared.curve import GATEWAY, WORKER, public_file, secret_file

_WORKER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def make_pair(keys_dir: Path, name: str) -> None:
    """`keys_dir/name.key` and `name.key_secret` (0600), unless a secret is there already."""
    keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if secret_file(keys_dir, name).exists():
        return
    public, secret = zmq.auth.create_certificates(keys_dir, name)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)


def new_worker_pair(keys_dir: Path) -> str:
    """A fresh worker pair in `keys_dir` (any old one replaced); the public certificate's text."""
    for stale in (public_file(keys_dir, WORKER), secret_file(keys_dir, WORKER)):
        stale.unlink(missing_ok=True)
    make_pair(keys_dir, WORKER)
    return public_file(keys_dir, WORKER).read_text()


def admit(keys_dir: Path, worker_id: str, public_text: str) -> None:
    """Add (or replace) `worker_id`'s public key in the gateway's allowed set."""
    if not _WORKER_ID.match(worker_id) or worker_id == GATEWAY:
        raise ValueError(f"worker id {worker_id!r} cannot name a key file")
    fd, tmp = tempfile.mkstemp(prefix=".admit-", suffix=".tmp", dir=keys_dir)  # not *.key: never half-read
    try:
        with os.fdopen(fd, "w") as f:
            f.write(public_text)
        public, secret = zmq.auth.load_certificate(tmp)  # refuses anything but a certificate
        if secret is not None:
            raise ValueError(f"{worker_id} sent a secret key; only its public key may travel")
        os.chmod(tmp, 0o644)
        os.replace(tmp, public_file(keys_dir, worker_id))  # the gateway never sees half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def revoke(keys_dir: Path, worker_id: str) -> None:
    if _WORKER_ID.match(worker_id) and worker_id != GATEWAY:
        public_file(keys_dir, worker_id).unlink(missing_ok=True)


def write_gateway_public(keys_dir: Path, public_text: str) -> None:
    path = public_file(keys_dir, GATEWAY)
    path.write_text(public_text)
    zmq.auth.load_certificate(path)  # a certificate, or ValueError
