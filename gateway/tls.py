"""TLS for the gateway's front doors: the certificate files of `[gateway]`, read once and checked,
as gRPC server credentials and as the arguments uvicorn takes. A client CA turns on client
certificate verification (mutual TLS) on both."""
from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from shared.config import ConfigError, GatewayConfig


@dataclass(frozen=True)
class TlsFiles:
    cert_file: str
    key_file: str
    client_ca_file: str = ""

    def read(self, name: str) -> bytes:
        path = getattr(self, name)
        try:
            return Path(path).read_bytes()
        except OSError as e:
            raise ConfigError(f"gateway.tls_{name}: cannot read {path}: {e.strerror}") from None

    def uvicorn_args(self) -> dict:
        return {"ssl_certfile": self.cert_file, "ssl_keyfile": self.key_file,
                "ssl_ca_certs": self.client_ca_file or None,
                "ssl_cert_reqs": ssl.CERT_REQUIRED if self.client_ca_file else ssl.CERT_NONE}


def tls_files(config: GatewayConfig) -> TlsFiles | None:
    if not config.tls_cert_file:
        return None
    files = TlsFiles(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)
    for name in ("cert_file", "key_file") + (("client_ca_file",) if files.client_ca_file else ()):
        files.read(name)  # unreadable files fail the start, by name
    return files


def grpc_server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    ca = files.read("client_ca_file") if files.client_ca_file else None
    return grpc.ssl_server_credentials([(files.read("key_file"), files.read("cert_file"))], root_certificates=ca,
                                       require_client_auth=ca is not None)
