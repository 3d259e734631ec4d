"""TLS and protected mode on real processes: gRPC and HTTPS with a certificate made here (and with
client certificates required), plaintext refused on the TLS port, the client CLI's --tls-ca and
--api-key, the gateway's refusal to serve a non-loopback address without keys, and the default
listening on loopback only."""
from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import psutil
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from bench.cluster_process import free_port, render_config
from cluster_harness import ROOT, Cluster, generate
from protos import inference_pb2_grpc

pytestmark = pytest.mark.timeout(300)
API_KEY = "tls-test-key-0123456789abcdef"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, key, issuer: str, issuer_key, is_ca: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
    if not is_ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 / localhost and a client certificate, all signed by it."""
    folder = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    files = {"ca.pem": _certificate("test CA", ca_key, "test CA", ca_key, is_ca=True)}
    for role in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        files[f"{role}.pem"] = _certificate(f"test {role}", key, "test CA", ca_key)
        (folder / f"{role}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                               serialization.PrivateFormat.PKCS8,
                                                               serialization.NoEncryption()))
    for name, cert in files.items():
        (folder / name).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "keys").write_text(f"{API_KEY} name=tls-user\n")
    return folder


def tls_sections(pki, client_ca: bool = False) -> dict:
    return {"gateway": {"tls_cert_file": str(pki / "server.pem"), "tls_key_file": str(pki / "server.key"),
                        "http_port": free_port(), "api_keys_file": str(pki / "keys"),
                        **({"tls_client_ca_file": str(pki / "ca.pem")} if client_ca else {})}}


def test_grpc_and_https_over_tls_and_plaintext_refused(served_checkpoint, pki):
    ca = (pki / "ca.pem").read_bytes()
    sections = tls_sections(pki)
    sections["gateway"]["read_timeout_s"] = 3.0
    with Cluster(served_checkpoint, num_workers=1, sections=sections, api_key=API_KEY, tls_root=ca) as c:
        # A connection that never starts its TLS handshake is closed after read_timeout_s (asyncio's
        # default would hold it 60 s), as an idle plaintext one is.
        with socket.create_connection(("127.0.0.1", c.http_port), timeout=30) as idle:
            assert idle.recv(1) == b""
        ids, _, _ = generate(c.stub, prompt_token_ids=[5, 6, 7], sampling={"max_tokens": 3, "ignore_eos": True},
                             metadata=c.metadata)
        assert len(ids) == 3
        with grpc.insecure_channel(c.address) as plain:
            with pytest.raises(grpc.RpcError) as e:
                generate(inference_pb2_grpc.InferenceServiceStub(plain), timeout=5, prompt_token_ids=[5],
                         metadata=c.metadata)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        with urllib.request.urlopen(f"https://127.0.0.1:{c.http_port}/health", context=context, timeout=5) as r:
            assert r.status == 200
        body = json.dumps({"model": "llama", "prompt": "hi", "max_tokens": 2}).encode()
        request = urllib.request.Request(f"https://localhost:{c.http_port}/v1/completions", data=body, headers={
            "content-type": "application/json", "authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(request, context=context, timeout=30) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] >= 1
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://127.0.0.1:{c.http_port}/health", timeout=5).read()
        # The CLI: --tls-ca, and the key from $INFERENCE_API_KEY (then from --api-key).
        cli = [sys.executable, "-m", "gateway.client", "hi", "--max-tokens", "3", "--ignore-eos", "--address",
               c.address, "--tls-ca", str(pki / "ca.pem")]
        env = {**os.environ, "INFERENCE_API_KEY": API_KEY}
        done = subprocess.run(cli, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        env.pop("INFERENCE_API_KEY")
        done = subprocess.run(cli, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and "UNAUTHENTICATED" in done.stderr
        done = subprocess.run([*cli, "--api-key", API_KEY], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr


def test_client_certificates_are_required_when_a_client_ca_is_set(served_checkpoint, pki):
    ca = (pki / "ca.pem").read_bytes()
    sections = tls_sections(pki, client_ca=True)
    # The harness's own channel presents no certificate, so readiness is read from the gateway's log.
    cluster = Cluster(served_checkpoint, num_workers=1, sections=sections, api_key=API_KEY, tls_root=ca)
    with_cert = grpc.ssl_channel_credentials(ca, (pki / "client.key").read_bytes(), (pki / "client.pem").read_bytes())
    try:
        cluster._spawn("gateway", ["gateway"])
        cluster._spawn("worker-0", ["worker", "--worker-id", "worker-0"])
        with grpc.secure_channel(cluster.address, with_cert) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            deadline = time.monotonic() + 120
            while True:
                try:
                    ids, _, _ = generate(stub, timeout=10, prompt_token_ids=[5, 6], metadata=cluster.metadata,
                                         sampling={"max_tokens": 2, "ignore_eos": True})
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline, cluster.logs("gateway")
                    time.sleep(0.2)
            assert len(ids) == 2
        with grpc.secure_channel(cluster.address, grpc.ssl_channel_credentials(ca)) as channel:
            with pytest.raises(grpc.RpcError) as e:
                generate(inference_pb2_grpc.InferenceServiceStub(channel), timeout=5, prompt_token_ids=[5],
                         metadata=cluster.metadata)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        no_cert = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            urllib.request.urlopen(f"https://127.0.0.1:{cluster.http_port}/health", context=no_cert, timeout=5).read()
        no_cert.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
        with urllib.request.urlopen(f"https://127.0.0.1:{cluster.http_port}/health", context=no_cert, timeout=5) as r:
            assert r.status == 200
    finally:
        cluster.stop()


def _gateway(served_checkpoint, tmp_path, *flags: str) -> subprocess.Popen:
    """A gateway alone (no workers) on a config that leaves host and metrics_host at their defaults."""
    config = tmp_path / "cluster.toml"
    config.write_text(render_config({"model_dir": str(served_checkpoint), "num_workers": 1,
                                     "run_dir": str(tmp_path / "run")},
                                    {"gateway": {"port": free_port(), "metrics_port": free_port(),
                                                 "http_port": free_port()}}))
    return subprocess.Popen([sys.executable, "-m", "gateway", "--config", str(config), *flags], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _listening(proc: subprocess.Popen, count: int) -> list[str]:
    """The addresses the gateway listens on, once it listens on `count` of them."""
    deadline = time.monotonic() + 60
    while True:
        # One snapshot for both: read apart, the addresses may predate a server the ports include.
        listening = [c.laddr for c in psutil.Process(proc.pid).net_connections("inet")
                     if c.status == psutil.CONN_LISTEN]
        if len({a.port for a in listening}) >= count:
            return sorted({a.ip for a in listening})
        assert proc.poll() is None and time.monotonic() < deadline, (
            proc.stdout.read() if proc.poll() is not None else "still not listening")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def test_by_default_every_port_listens_on_loopback_only(served_checkpoint, tmp_path):
    proc = _gateway(served_checkpoint, tmp_path)
    try:
        addresses = [ipaddress.ip_address(a) for a in _listening(proc, 3)]  # gRPC, HTTP and metrics
        # gRPC listens on an IPv6 socket: its 127.0.0.1 shows as ::ffff:127.0.0.1.
        assert addresses and all((getattr(a, "ipv4_mapped", None) or a).is_loopback for a in addresses), addresses
    finally:
        _stop(proc)


def test_a_non_loopback_address_without_keys_refuses_to_start(served_checkpoint, tmp_path):
    for module in (["gateway"], ["gateway", "--supervise"]):
        done = subprocess.run([sys.executable, "-m", *module, "--gateway.host", "0.0.0.0", "--model_dir",
                               str(served_checkpoint), "--run_dir", str(tmp_path / "run")], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "allow_unauthenticated" in done.stderr and "api_keys_file" in done.stderr, (
            module, done.returncode, done.stderr[-2000:])
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr  # the reason alone, not argparse's usage
    keys = tmp_path / "keys"
    keys.write_text(f"{API_KEY}\n")
    for flags in (["--gateway.api_keys_file", str(keys)], ["--gateway.allow_unauthenticated", "true"]):
        proc = _gateway(served_checkpoint, tmp_path, "--gateway.host", "0.0.0.0", *flags)
        try:
            assert "0.0.0.0" in _listening(proc, 3)
        finally:
            _stop(proc)
