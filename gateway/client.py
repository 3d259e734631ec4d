"""`python -m gateway.client "Once upon a time" --max-tokens 64`: stream a completion to the terminal.

`python -m gateway.client status` prints each worker's health, load and memory as a table;
`python -m gateway.client probe worker-0 --deep --memory` probes one worker (either word may also
follow the connection options: `--address A status`). `--address` takes
one gateway or several, comma-separated (`host:port,host:port`): requests are balanced over them
(gateway/gateway_pool.py), `status` prints each gateway's table and `probe` asks each in turn.
Flags cover chat (`--chat`, `--system`), priority, sampling, log-probabilities, a session,
structured output (`--json-schema`, `--regex`, `--choice`) and a timeout. `--api-key` (or
INFERENCE_API_KEY) sends an API key; `--tls-ca FILE` connects over TLS trusting that CA (and
`--tls-cert` / `--tls-key` present a client certificate). Exit status is 0 on success, 1 on a
gRPC error (its status and message go to stderr).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import grpc

from gateway.gateway_pool import GatewayPool, parse_addresses
from protos import inference_pb2

FINISH_NAMES = {v: k.removeprefix("FINISH_REASON_").lower() for k, v in inference_pb2.FinishReason.items()}
INT32 = (-2**31, 2**31 - 1)
UINT32 = (0, 2**32 - 1)
UINT64 = (0, 2**64 - 1)


def wire_int(bounds: tuple[int, int]) -> Callable[[str], int]:
    """An argparse type for an integer flag that fills a proto field of these bounds: a value the
    field cannot hold is a usage error naming the flag, not a traceback from protobuf. What the
    server accepts within them (e.g. --logprobs up to 20) is the server's to say."""
    low, high = bounds

    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside the field's range [{low}, {high}]")
        return value
    parse.__name__ = "integer"  # argparse names the type in "invalid integer value: ..."
    return parse


def seconds(text: str) -> float:
    """A positive, finite number of seconds (--timeout)."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is not a positive, finite number of seconds")
    return value


def build_request(args: argparse.Namespace) -> inference_pb2.GenerateRequest:
    request = inference_pb2.GenerateRequest(priority=args.priority, request_id=args.request_id or "")
    if args.chat:
        if args.system:
            request.messages.add(role="system", content=args.system)
        request.messages.add(role="user", content=args.prompt)
    else:
        request.prompt = args.prompt
    s = request.sampling
    s.max_tokens = args.max_tokens
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "speculative_ngram_k"):
        value = getattr(args, name)
        if value is not None:
            setattr(s, name, value)
    s.stop.extend(args.stop or [])
    s.ignore_eos = args.ignore_eos
    if args.logprobs is not None:
        s.logprobs = args.logprobs
    if args.prompt_logprobs is not None:
        s.prompt_logprobs = args.prompt_logprobs
    request.session_id = args.session or ""
    given = [(kind, value) for kind, value in (("json_schema", args.json_schema), ("regex", args.regex))
             if value is not None]
    if args.choice:
        given.append(("choice", args.choice))
    if len(given) > 1:
        raise SystemExit("give at most one of --json-schema, --regex and --choice")
    if given:
        kind, value = given[0]
        if kind == "choice":
            s.structured_output.choice.choices.extend(value)
        else:
            setattr(s.structured_output, kind, value)
    return request


def channel_opener(args: argparse.Namespace) -> Callable[[str], grpc.Channel]:
    """How to open a channel to one gateway: TLS when --tls-ca is given."""
    if not args.tls_ca:
        if args.tls_cert or args.tls_key:
            raise SystemExit("--tls-cert and --tls-key need --tls-ca")
        return grpc.insecure_channel
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("give --tls-cert and --tls-key together")
    def read(flag: str, path: str | None) -> bytes | None:
        try:
            return Path(path).read_bytes() if path else None
        except OSError as e:
            raise SystemExit(f"{flag}: cannot read {path}: {e.strerror}") from None
    credentials = grpc.ssl_channel_credentials(read("--tls-ca", args.tls_ca), read("--tls-key", args.tls_key),
                                               read("--tls-cert", args.tls_cert))
    return lambda address: grpc.secure_channel(address, credentials)


def open_pool(args: argparse.Namespace) -> GatewayPool:
    """The gateways of --address (one, or several comma-separated) behind one pool."""
    try:
        addresses = parse_addresses(args.address)
    except ValueError as e:
        raise SystemExit(f"--address: {e}") from None
    return GatewayPool(addresses, channel_opener(args))


def call_metadata(args: argparse.Namespace) -> tuple:
    return (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()


def generate(args: argparse.Namespace) -> int:
    with open_pool(args) as pool:
        last, logprobs, prompt_logprobs = None, [], []
        try:
            for response in pool.generate(build_request(args), timeout=args.timeout, metadata=call_metadata(args)):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                logprobs.extend(response.logprobs)
                prompt_logprobs.extend(response.prompt_logprobs)
                last = response
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print()
    # The prompt's (from its second token, with its rank), then the output's: token id, log-probability,
    # then the most likely alternatives.
    for entry in prompt_logprobs + logprobs:
        alternatives = " ".join(f"{t.token_id}:{t.logprob:.3f}" for t in entry.top)
        rank = f"\trank {entry.rank}" if entry.rank else ""
        print(f"{entry.token_id}\t{entry.logprob:.4f}\t{alternatives}{rank}", file=sys.stderr)
    if last is not None and args.verbose:
        u, t = last.usage, last.timing
        print(f"[{last.request_id} on {last.worker_id}: {FINISH_NAMES[last.finish_reason]}; "
              f"{u.prompt_tokens} prompt + {u.completion_tokens} completion tokens "
              f"({u.cached_prompt_tokens} cached); queue {t.queue_ms:.1f} ms, "
              f"first token {t.time_to_first_token_ms:.1f} ms, total {t.total_ms:.1f} ms]", file=sys.stderr)
    return 0


def status(args: argparse.Namespace) -> int:
    """Each gateway's table, under its address when there are several (each owns its workers)."""
    rc = 0
    with open_pool(args) as pool:
        for address in pool.addresses:
            heading = f"gateway {address}:\n" if len(pool.addresses) > 1 else ""
            try:
                cluster = pool.stub(address).GetClusterStatus(inference_pb2.GetClusterStatusRequest(),
                                                              timeout=args.timeout, metadata=call_metadata(args))
            except grpc.RpcError as e:
                print(f"{heading}error: {e.code().name}: {e.details()}", file=sys.stderr)
                rc = 1
                continue
            print(heading + format_status(cluster))
    return rc


def probe(args: argparse.Namespace) -> int:
    """Probe the worker on whichever gateway owns it (the others answer NOT_FOUND)."""
    request = inference_pb2.ProbeWorkerRequest(worker_id=args.worker_id, deep=args.deep, memory_report=args.memory)
    with open_pool(args) as pool:
        errors = []
        for address in pool.addresses:
            try:
                reply = pool.stub(address).ProbeWorker(request, timeout=args.timeout, metadata=call_metadata(args))
                break
            except grpc.RpcError as e:
                where = f"gateway {address}: " if len(pool.addresses) > 1 else ""
                errors.append(f"{where}error: {e.code().name}: {e.details()}")
        else:
            print("\n".join(errors), file=sys.stderr)
            return 1
    print(f"{reply.worker_id}: {'ok' if reply.ok else 'FAILED'} in {reply.latency_ms:.1f} ms"
          f"{' - ' + reply.error if reply.error else ''}")
    if reply.memory_report:
        print(reply.memory_report)
    return 0 if reply.ok else 1


def format_status(cluster: inference_pb2.ClusterStatus) -> str:
    header = ("worker", "alive", "ready", "running", "waiting", "kv free/total", "memory", "level", "util",
              "heartbeat", "restarts")
    rows = [header]
    for w in cluster.workers:
        memory = (f"{w.memory_used_bytes / 2**20:.0f}/{w.memory_limit_bytes / 2**20:.0f} MiB"
                  if w.memory_limit_bytes else "-")
        rows.append((w.worker_id, "yes" if w.alive else "no", "yes" if w.ready else "no", str(w.num_running),
                     str(w.num_waiting), f"{w.kv_blocks_free}/{w.kv_blocks_total}", memory,
                     (w.memory_level or "-") + (" HUNG" if w.hung else ""), f"{w.utilization_percent:.0f}%",
                     f"{w.last_heartbeat_age_s:.2f} s" if w.last_heartbeat_age_s < 1e8 else "never",
                     str(w.num_restarts)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines += [f"{w.worker_id} exited: {w.exit_reason}" for w in cluster.workers if w.exit_reason]
    lines.append(f"queued: {cluster.num_queued}{'  (draining)' if cluster.draining else ''}")
    return "\n".join(lines)


# The connection options every subcommand takes, with the value each is followed by.
_CONNECTION_OPTIONS = ("--address", "--timeout", "--api-key", "--tls-ca", "--tls-cert", "--tls-key")


def _subcommand_first(argv: list[str]) -> list[str]:
    """argv with a `status` or `probe` that follows connection options moved to the front
    (`--address A status` as `status --address A`); anything else is a generation's argv."""
    i = 0
    while i < len(argv):
        if argv[i] in _CONNECTION_OPTIONS:
            i += 2
        elif argv[i].split("=", 1)[0] in _CONNECTION_OPTIONS:
            i += 1
        elif argv[i] in ("status", "probe"):
            return [argv[i], *argv[:i], *argv[i + 1:]]
        else:
            break
    return argv


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--address", default="localhost:50051",
                        help="the gateway's host:port, or several comma-separated: each request goes to one of "
                             "them, a session's requests to the same one (gateway/gateway_pool.py)")
    common.add_argument("--timeout", type=seconds, default=None, help="the request's deadline in seconds")
    common.add_argument("--api-key", default=os.environ.get("INFERENCE_API_KEY"),
                        help="the API key (default: $INFERENCE_API_KEY)")
    common.add_argument("--tls-ca", default=None, metavar="FILE", help="connect over TLS, trusting this CA (PEM)")
    common.add_argument("--tls-cert", default=None, metavar="FILE", help="a client certificate (PEM), for mutual TLS")
    common.add_argument("--tls-key", default=None, metavar="FILE", help="the client certificate's key (PEM)")
    argv = _subcommand_first(argv)
    if argv[:1] == ["status"]:
        parser = argparse.ArgumentParser(prog="python -m gateway.client status", parents=[common])
        return status(parser.parse_args(argv[1:]))
    if argv[:1] == ["probe"]:
        parser = argparse.ArgumentParser(prog="python -m gateway.client probe", parents=[common])
        parser.add_argument("worker_id")
        parser.add_argument("--deep", action="store_true", help="run a real one-token generation")
        parser.add_argument("--memory", action="store_true", help="print the worker's full memory report")
        return probe(parser.parse_args(argv[1:]))
    parser = argparse.ArgumentParser(prog="python -m gateway.client", parents=[common], description=__doc__)
    parser.add_argument("prompt")
    parser.add_argument("--max-tokens", type=wire_int(INT32), default=64)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=wire_int(INT32), default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=None)
    parser.add_argument("--seed", type=wire_int(UINT64), default=None)
    parser.add_argument("--speculative-ngram-k", type=wire_int(UINT32), default=None, metavar="K",
                        help="draft up to K tokens a step by prompt lookup (0: off; default: the server's)")
    parser.add_argument("--stop", action="append", help="a stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--priority", type=wire_int(INT32), default=0, help="lower is served first")
    parser.add_argument("--request-id", default=None)
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    parser.add_argument("--system", default=None, help="a system message (with --chat)")
    parser.add_argument("--logprobs", type=wire_int(UINT32), default=None, metavar="N",
                        help="print each token's log-probability and its N (0-20) most likely alternatives")
    parser.add_argument("--prompt-logprobs", type=wire_int(UINT32), default=None, metavar="N",
                        help="print the prompt's too (each token after the first, its rank and N alternatives)")
    parser.add_argument("--session", "--session-id", dest="session", default=None,
                        help="a session id: its requests go to one gateway and one worker")
    parser.add_argument("--json-schema", default=None, metavar="JSON", help="constrain the output to this JSON Schema")
    parser.add_argument("--regex", default=None, help="constrain the output to match this regex")
    parser.add_argument("--choice", action="append", help="constrain the output to one of these (repeatable)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print usage and timing at the end")
    return generate(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
