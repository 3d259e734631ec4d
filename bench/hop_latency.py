"""One-way latency of the cluster's two transports alone, each between two processes on this machine.

- ZeroMQ: a DEALER in a child process sends a frame every interval over ipc:// to a ROUTER here
  (the worker -> gateway hop, without the gateway).
- gRPC: a grpc.aio server in a child process streams GenerateResponse messages every interval
  to a grpc.aio client here (the gateway -> client hop, without the dispatcher or detokenizer).
Each message carries its send time (time.perf_counter: CLOCK_MONOTONIC, shared by processes
on Linux), so the receiver gets the one-way latency. `python -m bench.hop_latency` prints both;
the child roles are `--zmq-sender ENDPOINT` and `--grpc-server PORT`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
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
def zmq_sender(endpoint: str, count: int, interval_s: float) -> int:
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"probe")
    sock.connect(endpoint)
    time.sleep(0.5)  # let the connection settle before timing
    for _ in range(count):
        sock.send(struct.pack("d", time.perf_counter()))
        time.sleep(interval_s)
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


def measure_zmq(count: int = 200, interval_s: float = 0.02) -> dict:
    import zmq

    run_dir = Path(tempfile.mkdtemp(prefix="icb-hop-"))
    endpoint = f"ipc://{run_dir}/hop.ipc"
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    proc = _spawn(["--zmq-sender", endpoint, "--count", str(count), "--interval", str(interval_s)])
    latencies = []
    try:
        deadline = time.monotonic() + START_TIMEOUT_S + count * interval_s
        while len(latencies) < count and time.monotonic() < deadline:
            if sock.poll(1000):
                _identity, frame = sock.recv_multipart()
                latencies.append((time.perf_counter() - struct.unpack("d", frame)[0]) * 1e3)
    finally:
        _reap(proc)
        sock.close()
        Path(endpoint[len("ipc://"):]).unlink(missing_ok=True)
        run_dir.rmdir()
    return _stats(latencies)


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
    args = p.parse_args(argv)
    if args.zmq_sender:
        return zmq_sender(args.zmq_sender, args.count, args.interval)
    if args.grpc_server:
        return grpc_server(args.grpc_server)
    for name, fn in (("ZeroMQ ipc DEALER -> ROUTER", measure_zmq), ("gRPC aio server stream -> client", measure_grpc)):
        s = fn(args.count, args.interval)
        print(f"{name:<34} one-way ms p50 {s['p50_ms']:.3f}  p90 {s['p90_ms']:.3f}  p99 {s['p99_ms']:.3f}  "
              f"(n={s['n']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
