"""Health checks for container probes: ask a gateway's grpc.health.v1 service, or look for a local process.

    python -m tools.health_probe --address HOST:PORT [--service NAME] [--tls-ca FILE]
                                 [--tls-cert FILE --tls-key FILE] [--timeout S]
    python -m tools.health_probe --address 127.0.0.1:50051 --alive     # the gateway answers at all
    python -m tools.health_probe --process worker                      # a `python -m worker` runs here

Exit 0 when the service is SERVING (with `--alive`: when the health service answers at all,
SERVING or not; with `--process`: when a matching process is running), 1 otherwise; the status
is printed either way. Health needs no API key. A worker pod has no port of its own, so its
readiness asks the gateway about it (service = its worker id); `--process` needs no network, so a
worker's liveness never depends on the gateway being up. Kubernetes' native gRPC probe cannot
speak TLS; this one can (`--tls-ca`, `--tls-server-name`), and with mutual TLS (the gateway's
`tls_client_ca_file`: every caller of its port shows a certificate, health included) it presents
a client certificate (`--tls-cert`, `--tls-key`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_TIMEOUT_S = 5.0
_OPTIONS_WITH_VALUE = {"-W", "-X", "--check-hash-based-pycs"}  # the interpreter's own


def check_health(address: str, service: str = "", tls_ca: Path | None = None, tls_server_name: str = "",
                 timeout_s: float = DEFAULT_TIMEOUT_S, tls_cert: Path | None = None,
                 tls_key: Path | None = None) -> str:
    """The status name the health service reports for `service` (SERVING, NOT_SERVING, ...), or
    `SERVICE_UNKNOWN` when it has no such service, or `UNREACHABLE: <why>` when nothing answered."""
    import grpc  # here, so `--process` runs on the standard library alone (fast, every few seconds)
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    options = [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []
    if tls_ca is not None:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=Path(tls_ca).read_bytes(),
            private_key=Path(tls_key).read_bytes() if tls_key else None,
            certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None)
        channel = grpc.secure_channel(address, credentials, options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            return f"UNREACHABLE: {e.code().name} {e.details() or ''}".rstrip()
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def module_of(argv: list[str]) -> str | None:
    """The module a Python command line runs with `-m` (`python -u -m worker --x` -> "worker"), or None."""
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return argv[i + 1] if i + 1 < len(argv) else None
        if arg.startswith("-m"):  # `python -mworker`
            return arg[2:]
        if arg in ("-c", "-") or not arg.startswith("-"):  # a script or -c: the rest are its arguments
            return None
        i += 2 if arg in _OPTIONS_WITH_VALUE else 1
    return None


def find_process(module: str, proc_root: Path = Path("/proc")) -> int | None:
    """The pid of a live process running `python -m <module>` exactly (not `<module>.supervisor`), or None."""
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rpartition(")")[2].split()[:1]
        except OSError:  # gone since the listing, or not ours to read
            continue
        if state == ["Z"]:  # a zombie has exited; its parent has not reaped it yet
            continue
        argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
        if argv and module_of(argv) == module:
            return int(entry.name)
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.health_probe", description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--address", help="the gateway's gRPC address, HOST:PORT")
    target.add_argument("--process", metavar="MODULE", help="succeed when `python -m MODULE` runs on this host "
                                                            "(this container), asking no one")
    parser.add_argument("--service", default="", help='the health service: "" (the default) is the gateway as a '
                                                      "whole, a worker id that worker")
    parser.add_argument("--alive", action="store_true", help="succeed on any answer of the health service "
                                                             "(SERVING or not): a liveness check")
    parser.add_argument("--tls-ca", type=Path, help="CA certificate (PEM) when the gateway serves TLS")
    parser.add_argument("--tls-server-name", default="", help="the name the gateway's certificate is for, when "
                                                              "it is not the host of --address")
    parser.add_argument("--tls-cert", type=Path, help="a client certificate (PEM), when the gateway asks for one")
    parser.add_argument("--tls-key", type=Path, help="the client certificate's key (PEM)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds (default %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_cert and not args.tls_ca):
        parser.error("--tls-cert and --tls-key go together, with --tls-ca")
    if args.process:
        pid = find_process(args.process)
        print(f"{args.process}: running (pid {pid})" if pid else f"{args.process}: no such process")
        return 0 if pid else 1
    status = check_health(args.address, args.service, args.tls_ca, args.tls_server_name, args.timeout,
                          args.tls_cert, args.tls_key)
    print(f"{args.address} {args.service or '(overall)'}: {status}")
    if args.alive:
        return 0 if not status.startswith("UNREACHABLE") else 1
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
