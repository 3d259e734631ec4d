"""The `[gateway]` section of the cluster's configuration: the gateway's ports, bounds, timeouts,
security and API settings, validated. Stdlib only."""
from __future__ import annotations

from dataclasses import dataclass

from shared.engine_config import check as _check


@dataclass(frozen=True)
class GatewayConfig:
    # Loopback by default: a gateway reachable from other hosts must say who may call it
    # (api_keys_file / INFERENCE_API_KEY) or that anyone may (allow_unauthenticated).
    host: str = "127.0.0.1"
    port: int = 50051
    worker_endpoint: str = ""  # "" = ipc://<run_dir>/gateway.ipc; tcp://host:port by config
    heartbeat_timeout_s: float = 1.0  # no heartbeat for this long: the worker is dead
    drain_grace_s: float = 30.0  # SIGTERM: how long in-flight streams may run on
    default_max_tokens: int = 64  # a prompt's (gRPC, /v1/completions) that sets none
    # A chat's (messages: gRPC, /v1/chat/completions) that sets none; 0 = as many as fit, the rest
    # of the model's context within the largest live worker's KV pool (OpenAI's and vLLM's default).
    chat_default_max_tokens: int = 0
    request_timeout_s: float = 0.0  # 0 = only the client's own deadline applies
    max_concurrent_streams: int = 1024
    metrics_port: int = 8000  # Prometheus /metrics over HTTP; 0 = off
    metrics_host: str = "127.0.0.1"
    probe_timeout_s: float = 10.0  # ProbeWorker: how long to wait for the worker's reply
    # Tokens per GenerateResponse (as vLLM's and SGLang's --stream-interval): 1 streams every token
    # as it comes; N > 1 holds a stream's tokens until N are ready, the request ends, or
    # stream_hold_ms passes. The first token always leaves at once. Larger N trades streaming
    # granularity for host CPU: gRPC's cost is per message, on the gateway and on the client.
    stream_interval: int = 1
    stream_hold_ms: float = 50.0
    # Request size bounds, checked before any tokenizing or rendering: every size a client picks
    # is bounded before work is done on it. gRPC's message limit follows them (gateway/listen.py
    # max_request_bytes: 4 bytes a character they count, plus framing; about 17 MB by default).
    max_prompt_chars: int = 4 << 20
    max_chat_messages: int = 1024
    max_stop_strings: int = 16
    max_stop_chars: int = 256  # per stop string; a stream holds back at most this much text
    max_stop_token_ids: int = 256
    max_logit_bias: int = 1024  # logit_bias entries
    max_schema_bytes: int = 64 << 10  # a structured-output constraint's text (schema, regex, grammar, choices)
    # Threads that tokenize large prompts and render chat templates off the event loop.
    tokenizer_threads: int = 2
    # A stream whose worker died waits this long (never past its deadline) for a live worker
    # before it fails UNAVAILABLE: a restarted worker is often back within seconds. Not while the
    # gateway drains and every worker said it was stopping: none is coming back.
    resume_grace_s: float = 5.0
    # `python -m gateway --supervise`: first delay before restarting a gateway that exited, doubled
    # per quick crash up to worker.max_restart_backoff_s. A gateway loads no model, so it restarts
    # sooner than a worker: clients are refused for as long as it is down.
    restart_backoff_s: float = 0.1
    # The OpenAI-compatible HTTP API (gateway/http_api.py) on `host`; 0 turns it off.
    http_port: int = 8080
    # Let several gateway processes on this host share `port` and `http_port` (SO_REUSEPORT): the
    # kernel spreads new connections over them, not requests (docs/deployment.md). Each keeps its
    # own metrics_port and worker_endpoint, which must differ. Off: a taken port fails the start.
    reuse_port: bool = False
    served_model_name: str = ""  # the `model` clients name; "" = the model folder's name
    # How tool_choice "auto" reads calls out of the model's text (gateway/tool_parsers.py): "auto" =
    # the format the chat template teaches; "hermes", "llama3_json"; "none" = refuse "auto".
    tool_call_parser: str = "auto"
    # A reasoning model's thinking (<think>...</think>) answered apart, as `reasoning`
    # (gateway/reasoning_parser.py): "auto" = where the chat template knows </think>; "think"; "none".
    reasoning_parser: str = "auto"
    max_body_bytes: int = 16 << 20  # an HTTP body beyond this is refused 413 before it is parsed
    # An HTTP body's JSON is parsed on the event loop, at a cost per value (each token id, each
    # logit_bias entry): a body of more values is refused 413 before it is parsed.
    max_body_values: int = 1 << 20
    # An HTTP request's head (request line and headers) at most this long (431), and arriving
    # within read_timeout_s, as must each chunk of its body (408 / the connection closed); a gRPC
    # connection's handshake and a metrics scrape's request get as long.
    max_header_bytes: int = 64 << 10
    read_timeout_s: float = 20.0
    # Connections open at once on each public port (gRPC, HTTP): one more is closed at once (HTTP:
    # answered 503 first), so a flood of connections cannot take the file descriptors every stream
    # and worker socket needs. The gateway raises its open-files limit to fit, up to the hard limit.
    max_connections: int = 4096
    # Browser pages of these origins may call the HTTP API (CORS; "*" = any); () = none. A
    # preflight is answered before the key check, which still holds for the call itself.
    cors_allow_origins: tuple[str, ...] = ()
    max_n: int = 16  # choices per request (`n`)
    max_prompts: int = 256  # prompts per /v1/completions request (a list of prompts)
    # Who may call (gateway/auth.py, docs/security.md): one key per line with its name, role and
    # limits; or the INFERENCE_API_KEY environment variable for a single (admin) key. No keys:
    # anyone who can reach the ports may call, which a non-loopback host refuses unless
    # allow_unauthenticated.
    api_keys_file: str = ""
    allow_unauthenticated: bool = False
    # TLS for gRPC and HTTP: both files (PEM) turn it on; a client CA also requires clients to
    # present a certificate it signed.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    # Who may join as a worker (shared/curve.py): ZeroMQ CURVE keys in zmq.auth's format
    # (tools/curve_keys.py writes them); "" = the cluster's own pair in <run_dir>/keys, made at
    # first start. Plain tcp:// without keys is refused unless allow_insecure_tcp.
    curve_keys_dir: str = ""
    allow_insecure_tcp: bool = False
    # A worker that joined by itself (not one of the num_workers this cluster launches) and has
    # been dead this long leaves the worker table, the status RPC, health and metrics.
    forget_worker_after_s: float = 30.0

    def validate(self) -> None:
        _check(0 <= self.port < 65536, "gateway.port", self.port, "in [0, 65535]")
        _check(0 <= self.http_port < 65536, "gateway.http_port", self.http_port, "in [0, 65535]")
        for name in ("max_body_bytes", "max_n", "max_prompts", "max_body_values", "max_header_bytes",
                     "max_connections", "max_prompt_chars", "max_chat_messages", "max_stop_chars",
                     "tokenizer_threads", "max_schema_bytes", "default_max_tokens", "stream_interval",
                     "max_concurrent_streams"):
            _check(getattr(self, name) >= 1, f"gateway.{name}", getattr(self, name), ">= 1")
        for name in ("read_timeout_s", "restart_backoff_s", "heartbeat_timeout_s", "probe_timeout_s",
                     "stream_hold_ms"):
            _check(getattr(self, name) > 0, f"gateway.{name}", getattr(self, name), "> 0")
        for name in ("max_stop_strings", "max_stop_token_ids", "max_logit_bias", "resume_grace_s", "drain_grace_s",
                     "request_timeout_s"):
            _check(getattr(self, name) >= 0, f"gateway.{name}", getattr(self, name), ">= 0")
        _check(self.forget_worker_after_s >= self.heartbeat_timeout_s, "gateway.forget_worker_after_s",
               self.forget_worker_after_s, ">= gateway.heartbeat_timeout_s")
        _check(self.tool_call_parser in ("auto", "none", "hermes", "llama3_json"), "gateway.tool_call_parser",
               self.tool_call_parser, "one of auto, none, hermes, llama3_json")
        _check(self.reasoning_parser in ("auto", "none", "think"), "gateway.reasoning_parser", self.reasoning_parser,
               "one of auto, none, think")
        _check(self.chat_default_max_tokens >= 0, "gateway.chat_default_max_tokens", self.chat_default_max_tokens,
               ">= 0 (0 = the rest of the context)")
        _check(0 <= self.metrics_port < 65536, "gateway.metrics_port", self.metrics_port, "in [0, 65535]")
        _check(bool(self.tls_cert_file) == bool(self.tls_key_file), "gateway.tls_cert_file", self.tls_cert_file,
               "set together with gateway.tls_key_file")
        _check(not self.tls_client_ca_file or bool(self.tls_cert_file), "gateway.tls_client_ca_file",
               self.tls_client_ca_file, "used with gateway.tls_cert_file and tls_key_file")
