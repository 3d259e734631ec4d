"""tools/health_probe.py, the container probe: against an in-process gRPC server with the standard
health servicer (plaintext and TLS), and its process check over real and made-up /proc entries."""
from __future__ import annotations

import datetime
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tools.health_probe import find_process, main, module_of

pytestmark = pytest.mark.timeout(60)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
SERVER_NAME = "inference-gateway-internal"  # the certificate's name, not the address dialled


def _health_server(credentials=None):
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = (server.add_secure_port("127.0.0.1:0", credentials) if credentials
            else server.add_insecure_port("127.0.0.1:0"))
    server.start()
    return server, servicer, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def gateway_like():
    """What the gateway reports with one worker ready and one not."""
    server, servicer, address = _health_server()
    servicer.set("", SERVING)
    servicer.set("worker-0", SERVING)
    servicer.set("worker-1", NOT_SERVING)
    yield servicer, address
    server.stop(grace=None)


def probe(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out.strip()


def test_serving_and_not(gateway_like, capsys):
    _, address = gateway_like
    assert probe(capsys, "--address", address) == (0, f"{address} (overall): SERVING")
    assert probe(capsys, "--address", address, "--service", "worker-0") == (0, f"{address} worker-0: SERVING")
    assert probe(capsys, "--address", address, "--service", "worker-1") == (1, f"{address} worker-1: NOT_SERVING")
    # A worker the gateway has never heard of (not joined yet) is not ready either.
    assert probe(capsys, "--address", address, "--service", "worker-9") == (1, f"{address} worker-9: SERVICE_UNKNOWN")


def test_alive_accepts_any_answer(gateway_like, capsys):
    servicer, address = gateway_like
    servicer.set("", NOT_SERVING)  # no worker ready: not ready, yet alive
    try:
        assert probe(capsys, "--address", address)[0] == 1
        assert probe(capsys, "--address", address, "--alive") == (0, f"{address} (overall): NOT_SERVING")
    finally:
        servicer.set("", SERVING)


def test_unreachable_fails_within_the_timeout(capsys):
    server, _, address = _health_server()
    server.stop(grace=None)  # a port that was just ours and is closed now
    start = time.monotonic()
    code, out = probe(capsys, "--address", address, "--alive", "--timeout", "1")
    assert code == 1 and out.startswith(f"{address} (overall): UNREACHABLE")
    assert time.monotonic() - start < 10


def _certificate(key, names: list[str]) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))


def test_tls_with_a_server_name(tmp_path, capsys):
    key = ec.generate_private_key(ec.SECP256R1())
    cert_pem = _certificate(key, [SERVER_NAME]).public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    (tmp_path / "ca.pem").write_bytes(cert_pem)  # self-signed: the certificate is its own CA
    server, _, address = _health_server(grpc.ssl_server_credentials([(key_pem, cert_pem)]))
    try:
        ca = str(tmp_path / "ca.pem")
        assert probe(capsys, "--address", address, "--tls-ca", ca, "--tls-server-name", SERVER_NAME)[0] == 0
        # Dialled by IP without the name, the certificate does not match: refused, not trusted.
        code, out = probe(capsys, "--address", address, "--tls-ca", ca, "--timeout", "2")
        assert code == 1 and "UNREACHABLE" in out
        # Plaintext against the TLS port gets no answer either.
        assert probe(capsys, "--address", address, "--timeout", "2")[0] == 1
    finally:
        server.stop(grace=None)


def test_mutual_tls_needs_the_probes_client_certificate(tmp_path, capsys):
    """A gateway with a client CA asks every caller of its port for a certificate, health included."""
    def pem_pair(names):
        key = ec.generate_private_key(ec.SECP256R1())
        return (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()),
                _certificate(key, names).public_bytes(serialization.Encoding.PEM))

    server_key, server_cert = pem_pair([SERVER_NAME])
    client_key, client_cert = pem_pair(["probe"])  # self-signed: its own CA, which the server trusts
    for name, data in (("ca.pem", server_cert), ("client.pem", client_cert), ("client.key", client_key)):
        (tmp_path / name).write_bytes(data)
    server, _, address = _health_server(grpc.ssl_server_credentials(
        [(server_key, server_cert)], root_certificates=client_cert, require_client_auth=True))
    try:
        tls = ["--address", address, "--tls-ca", str(tmp_path / "ca.pem"), "--tls-server-name", SERVER_NAME]
        code, out = probe(capsys, *tls, "--timeout", "2")
        assert code == 1 and "UNREACHABLE" in out  # no client certificate: the handshake fails
        client = ["--tls-cert", str(tmp_path / "client.pem"), "--tls-key", str(tmp_path / "client.key")]
        assert probe(capsys, *tls, *client)[0] == 0
        with pytest.raises(SystemExit):  # a certificate without its key is a usage error
            main(tls + client[:2])
    finally:
        server.stop(grace=None)


def test_module_of_a_command_line():
    assert module_of(["/usr/bin/python3", "-m", "worker", "--worker-id", "w"]) == "worker"
    assert module_of(["python", "-u", "-X", "dev", "-W", "ignore", "-mworker"]) == "worker"
    assert module_of(["python", "-m", "worker.supervisor", "--connect", "tcp://g:5555"]) == "worker.supervisor"
    assert module_of(["python", "script.py", "-m", "worker"]) is None  # the script's own arguments
    assert module_of(["python", "-c", "pass", "-m", "worker"]) is None
    assert module_of(["sh", "-c", "sleep 1"]) is None  # not -m anywhere before the command


def _fake_proc(root, pid: int, argv: list[str], state: str = "S") -> None:
    entry = root / str(pid)
    entry.mkdir()
    (entry / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (entry / "stat").write_text(f"{pid} (python3) {state} 1 1 1 0 -1\n")


def test_find_process_in_a_made_up_proc(tmp_path):
    _fake_proc(tmp_path, 1, ["/usr/local/bin/python", "-m", "worker.supervisor", "--worker-id", "w-0"])
    (tmp_path / "self").mkdir()  # non-pid entries are skipped
    assert find_process("worker", tmp_path) is None  # the supervisor alone: its model process is gone
    _fake_proc(tmp_path, 7, ["/usr/local/bin/python", "-m", "worker", "--worker-id", "w-0"], state="Z")
    assert find_process("worker", tmp_path) is None  # exited, not yet reaped
    _fake_proc(tmp_path, 8, ["/usr/local/bin/python", "-m", "worker", "--worker-id", "w-0"])
    assert find_process("worker", tmp_path) == 8
    assert find_process("worker.supervisor", tmp_path) == 1


def test_process_check_on_this_host(capsys):
    # A real `python -m MODULE` process (timeit sleeping), found while it runs, not after.
    proc = subprocess.Popen([sys.executable, "-m", "timeit", "-n", "1", "-r", "1", "-s", "import time",
                             "time.sleep(60)"])
    try:
        code, out = probe(capsys, "--process", "timeit")
        assert code == 0 and out == f"timeit: running (pid {proc.pid})"
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert probe(capsys, "--process", "timeit") == (1, "timeit: no such process")
