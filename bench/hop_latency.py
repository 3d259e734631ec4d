"""One-way latency of the cluster's two transports alone, each between two processes on this machine.

- ZeroMQ: a DEALER in a child process sends a frame every interval over ipc:// to a ROUTER here
  (the worker -> gateway hop, without the gateway).
- gRPC: a grpc.aio server in a child process streams GenerateResponse messages every interval
  to a grpc.aio client here (the gateway -> client hop, without the dispatcher or detokenizer).
Each message carries its send time (time.perf_counter: CLOCK_MONOTONIC, shared by processes
on Linux), so the receiver gets the one-way latency. `python -m bench.hop_latency` prints both;
the child roles are `--zmq-sender ENDPOINT` and `--grpc-server PORT`.

`--curve` measures what CURVE (shared/curve.py: every frame encrypted and authenticated) adds to
the ZeroMQ hop: plain and CURVE runs alternate for `--rounds` rounds, with frames of
`--frame-bytes`, and it prints each one's one-way latency, their ratios, and the sender's CPU
per frame of a back-to-back burst (`--burst` frames). The ZAP handler runs only at the
handshake, before the timing starts, so the receiver here has none; per frame it costs the same.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.load_stats import percentile

REPO_ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 30.0


# ---- child roles ----------------------------------------------------------------------------------
def zmq_sender(endpoint: str, count: int, interval_s: float, keys_dir: str | None = None,
               frame_bytes: int = 8) -> int:
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"probe")
    if keys_dir:
        from shared.curve import load_client_keys
        keys = load_client_keys(Path(keys_dir))
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys.public, keys.secret, keys.server_public
    sock.connect(endpoint)
    time.sleep(0.5)  # let the connection (and its handshake) settle before timing
    padding = b"\0" * max(0, frame_bytes - 8)
    started_cpu = time.process_time()
    for _ in range(count):
        sock.send(struct.pack("d", time.perf_counter()) + padding)
        if interval_s > 0:
            time.sleep(interval_s)
    if interval_s <= 0:  # a burst: the sender's CPU per frame, reported as the last frame
        sock.send(struct.pack("dd", -1.0, (time.process_time() - started_cpu) / count))
    time.sleep(0.5)  # the last frames leave before the socket closes
    sock.close()
    return 0


def grpc_server(port: int) -> int:
    import grpc

    from protos import inference_pb2, inference_pb2_grpc

    class Streamer(inference_pb2_grpc.InferenceServiceServicer):
        async def Generate(self, request, context):
            interval = request.sampling.temperature  # the interval travels in an otherwise unused field
            for _ in range(request.sampling.max_tokens):
                yield inference_pb2.GenerateResponse(text=repr(time.perf_counter()), token_ids=[100])
                await asyncio.sleep(interval)

    async def serve():
        server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(Streamer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await server.stop(grace=0.5)

    asyncio.run(serve())
    return 0


# ---- measurements ---------------------------------------------------------------------------------
def _spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "bench.hop_latency", *args], cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _reap(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def measure_zmq(count: int = 200, interval_s: float = 0.02, curve: bool = False, frame_bytes: int = 8) -> dict:
    """One-way latency of `count` frames, one per `interval_s`; `interval_s` 0 sends them
    back to back and also reports the sender's CPU per frame (`sender_cpu_us`)."""
    latencies, cpu = _zmq_hop(count, interval_s, curve, frame_bytes)
    stats = _stats(latencies)
    if cpu is not None:
        stats["sender_cpu_us"], stats["receiver_cpu_us"] = cpu[0] * 1e6, cpu[1] * 1e6
    return stats


def _zmq_hop(count: int, interval_s: float, curve: bool,
             frame_bytes: int) -> tuple[list[float], tuple[float, float] | None]:
    """The one-way latencies, and for a burst the CPU seconds per frame (sender, receiver), each
    process's whole CPU time: ZeroMQ encrypts and decrypts on its I/O threads."""
    import zmq

    run_dir = Path(tempfile.mkdtemp(prefix="icb-hop-"))
    endpoint = f"ipc://{run_dir}/hop.ipc"
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    args = ["--zmq-sender", endpoint, "--count", str(count), "--interval", str(interval_s),
            "--frame-bytes", str(frame_bytes)]
    if curve:
        from shared.curve import load_server_keys, write_keys
        write_keys(run_dir / "keys")
        keys = load_server_keys(run_dir / "keys")
        sock.curve_server = True
        sock.curve_secretkey, sock.curve_publickey = keys.secret, keys.public
        args += ["--curve-keys", str(run_dir / "keys")]
    sock.bind(endpoint)
    proc = _spawn(args)
    latencies, cpu, first_cpu_s = [], None, None
    try:
        deadline = time.monotonic() + START_TIMEOUT_S + count * interval_s
        while cpu is None and len(latencies) < count + (interval_s <= 0) and time.monotonic() < deadline:
            if sock.poll(1000):
                _identity, frame = sock.recv_multipart()
                sent_s = struct.unpack_from("d", frame)[0]
                if sent_s < 0:
                    receiver_s = (time.process_time() - first_cpu_s) / max(1, len(latencies) - 1)
                    cpu = (struct.unpack_from("dd", frame)[1], receiver_s)
                else:
                    if first_cpu_s is None:
                        first_cpu_s = time.process_time()
                    latencies.append((time.perf_counter() - sent_s) * 1e3)
    finally:
        _reap(proc)
        sock.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    return latencies, cpu


def compare_curve(count: int, interval_s: float, rounds: int, frame_bytes: int, burst: int) -> dict:
    """Plain and CURVE runs alternated `rounds` times (so drift in the machine's load hits both
    alike); latencies pooled per mode."""
    pooled = {False: [], True: []}
    cpu = {False: [], True: []}
    for _ in range(rounds):
        for curve in (False, True):
            pooled[curve] += _zmq_hop(count, interval_s, curve, frame_bytes)[0]
            if burst:
                per_frame = _zmq_hop(burst, 0.0, curve, frame_bytes)[1]
                if per_frame is not None:
                    cpu[curve].append(per_frame)
    out = {}
    for curve, name in ((False, "plain"), (True, "curve")):
        out[name] = _stats(pooled[curve])
        if cpu[curve]:  # medians over the rounds
            out[name]["sender_cpu_us"] = percentile([c[0] * 1e6 for c in cpu[curve]], 50)
            out[name]["receiver_cpu_us"] = percentile([c[1] * 1e6 for c in cpu[curve]], 50)
    return out


async def _grpc_client(port: int, count: int, interval_s: float) -> list[float]:
    import grpc

    from protos import inference_pb2, inference_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await asyncio.wait_for(channel.channel_ready(), START_TIMEOUT_S)
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        request = inference_pb2.GenerateRequest(prompt="x", sampling=inference_pb2.SamplingOptions(
            max_tokens=count, temperature=interval_s))
        latencies = []
        async for response in stub.Generate(request, timeout=START_TIMEOUT_S + count * interval_s):
            latencies.append((time.perf_counter() - float(response.text)) * 1e3)
        return latencies[5:]  # the first messages include the stream's set-up


def measure_grpc(count: int = 200, interval_s: float = 0.02) -> dict:
    from bench.cluster_process import free_port

    port = free_port()
    proc = _spawn(["--grpc-server", str(port)])
    try:
        latencies = asyncio.run(_grpc_client(port, count, interval_s))
    finally:
        _reap(proc)
    return _stats(latencies)


def _stats(latencies_ms: list[float]) -> dict:
    return {"n": len(latencies_ms), "p50_ms": percentile(latencies_ms, 50), "p90_ms": percentile(latencies_ms, 90),
            "p99_ms": percentile(latencies_ms, 99)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hop_latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zmq-sender", metavar="ENDPOINT", help=argparse.SUPPRESS)
    p.add_argument("--grpc-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=200)
    p.add_argument("--interval", type=float, default=0.02, help="seconds between messages")
    p.add_argument("--curve", action="store_true", help="ZeroMQ plain against CURVE, side by side")
    p.add_argument("--rounds", type=int, default=3, help="--curve: alternating plain/CURVE runs of --count each")
    p.add_argument("--frame-bytes", type=int, default=8, help="ZeroMQ frame size (at least the 8-byte timestamp)")
    p.add_argument("--burst", type=int, default=20000, help="--curve: frames sent back to back per CPU run (0: none)")
    p.add_argument("--curve-keys", metavar="DIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.zmq_sender:
        return zmq_sender(args.zmq_sender, args.count, args.interval, args.curve_keys, args.frame_bytes)
    if args.grpc_server:
        return grpc_server(args.grpc_server)
    if args.curve:
        result = compare_curve(args.count, args.interval, args.rounds, args.frame_bytes, args.burst)
        plain, curve = result["plain"], result["curve"]
        for name, s in (("ZeroMQ ipc plain", plain), ("ZeroMQ ipc CURVE", curve)):
            cpu = (f"  CPU/frame sender {s['sender_cpu_us']:.2f} us, receiver {s['receiver_cpu_us']:.2f} us"
                   if "sender_cpu_us" in s else "")
            print(f"{name:<18} one-way ms p50 {s['p50_ms']:.3f}  p90 {s['p90_ms']:.3f}  p99 {s['p99_ms']:.3f}  "
                  f"(n={s['n']}, {args.frame_bytes}-byte frames){cpu}")
        ratios = "  ".join(f"{q} {curve[f'{q}_ms'] / plain[f'{q}_ms']:.2f}x" for q in ("p50", "p90", "p99"))
        cpu = (f"  CPU/frame sender {curve['sender_cpu_us'] / plain['sender_cpu_us']:.2f}x, receiver "
               f"{curve['receiver_cpu_us'] / plain['receiver_cpu_us']:.2f}x" if "sender_cpu_us" in plain else "")
        print(f"CURVE / plain      {ratios}{cpu}")
        return 0
    for name, fn in (("ZeroMQ ipc DEALER -> ROUTER", measure_zmq), ("gRPC aio server stream -> client", measure_grpc)):
        s = fn(args.count, args.interval)
        print(f"{name:<34} one-way ms p50 {s['p50_ms']:.3f}  p90 {s['p90_ms']:.3f}  p99 {s['p99_ms']:.3f}  "
              f"(n={s['n']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
