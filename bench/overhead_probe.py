"""`python -m bench.overhead_probe [--profile]`: where the cluster's per-token overhead goes, measured in pieces.

1. Micro costs, in this process: the gateway's incremental detokenizer per token, protobuf
   encode + decode of a worker StepOutputs envelope and of a public GenerateResponse.
2. Each transport alone, between two processes (bench/hop_latency.py): ZeroMQ ipc and a gRPC
   aio stream, one-way.
3. The cluster path with no model: the real gateway in front of bench/fake_worker.py (one token
   per running request every --step-ms) and the load generator behind. Per token, the time from
   the fake worker's send to the client's receipt (ZeroMQ hop + gateway + gRPC + client), and the
   CPU each process spends per token; on a 2-core machine that CPU is taken from the model.
4. With --profile, the gateway runs under cProfile and the top functions by own time are printed.
"""

from __future__ import annotations

import argparse
import json
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.cluster_process import ClusterProcess
from bench.cpu_share import cpu_accounting
from bench.hop_latency import measure_grpc, measure_zmq
from bench.load_generator import run_load
from bench.load_stats import percentile
from bench.load_workload import LoadSpec, make_load_workload
from bench.serving_model import model_limits, resolve_model


def _timeit(fn, repeat: int) -> float:
    """Median microseconds per call over `repeat` calls, in batches to beat timer resolution."""
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        samples.append((time.perf_counter() - t0) / 20 * 1e6)
    return statistics.median(samples)


def micro_costs(model_dir: Path) -> dict:
    import random

    from gateway.tokenizer import IncrementalDetokenizer, Tokenizer
    from protos import inference_pb2, worker_pb2

    tok = Tokenizer(model_dir)
    rng = random.Random(0)
    ids = [rng.randrange(3, tok.vocab_size) for _ in range(5000)]
    detok = IncrementalDetokenizer(tok, ids[:64])
    it = iter(ids[64:])
    push_us = _timeit(lambda: detok.push([next(it)]), 100)

    def step_outputs(n):
        return worker_pb2.Envelope(worker_id="worker-0", incarnation="1-abc", outputs=worker_pb2.StepOutputs(
            deltas=[worker_pb2.TokenDelta(request_id=f"req-{i:016x}", new_token_ids=[1234], num_prompt_tokens=300)
                    for i in range(n)], step_ms=50.0))

    def roundtrip(msg, cls):
        return lambda: cls.FromString(msg.SerializeToString())

    out = {"detokenize_push_us": push_us}
    for n in (1, 16):
        out[f"step_outputs_{n}_encode_decode_us"] = _timeit(roundtrip(step_outputs(n), worker_pb2.Envelope), 50)
    response = inference_pb2.GenerateResponse(request_id="req-0123456789abcdef", text="abc", token_ids=[1234],
                                              worker_id="worker-0")
    out["generate_response_encode_decode_us"] = _timeit(roundtrip(response, inference_pb2.GenerateResponse), 50)
    return out


def path_latency(model_dir: Path, streams: int, step_ms: float, tokens: int, profile_to: Path | None) -> dict:
    vocab, ctx = model_limits(model_dir)
    spec = LoadSpec(num_requests=streams * 2, rate=0, long_fraction=0.0, short_prompt=(32, 32),
                    short_output=(tokens, tokens), seed=7)
    workload = make_load_workload(spec, vocab, ctx)
    gateway = ["cProfile", "-o", str(profile_to), "-m", "gateway"] if profile_to else None
    trace_dir = Path(tempfile.mkdtemp(prefix="icb-trace-"))
    trace_path = trace_dir / "trace.json"
    fake = ["bench.fake_worker", "--step-ms", str(step_ms), "--trace", str(trace_path)]
    cluster = ClusterProcess(model_dir, 1, {"worker": {"max_num_seqs": max(streams, 1), "max_queued": 0}},
                             gateway_module=gateway, worker_module=fake)
    acct: dict = {}
    try:
        cluster.start(ready_timeout_s=60)
        run_load(cluster.address, workload[:2], concurrency=2, request_prefix="warm", poll_status=False)
        with cpu_accounting(acct, cluster.cpu_seconds):
            result = run_load(cluster.address, workload, concurrency=streams, request_prefix="p", poll_status=False)
    finally:
        cluster.stop()  # the fake worker writes its trace as it exits
    trace = json.loads(trace_path.read_text()) if trace_path.exists() else {}
    shutil.rmtree(trace_dir, ignore_errors=True)
    t0 = result.extra["t0_perf_counter"]
    latencies = []
    for record in result.records:
        sends = trace.get(f"p-{record.index}", [])
        seen = 0
        for t, n in record.chunks:
            seen += n
            if seen <= len(sends):
                latencies.append((t0 + t - sends[seen - 1]) * 1e3)
    n_tokens = max(1, result.summary().output_tokens)
    cpu = {k: v / n_tokens * 1e6 for k, v in acct.get("cluster_cpu_s", {}).items()}
    cpu["client"] = acct.get("client_cpu_s", 0.0) / n_tokens * 1e6
    return {"streams": streams, "step_ms": step_ms, "tokens": n_tokens,
            "tokens_per_s": result.summary().tokens_per_s, "errors": result.summary().errors,
            "latency_ms_p50": percentile(latencies, 50), "latency_ms_p90": percentile(latencies, 90),
            "latency_ms_p99": percentile(latencies, 99), "cpu_us_per_token": cpu,
            "foreign_share": acct.get("foreign_share")}


def print_profile(path: Path, top: int = 25) -> None:
    if not path.exists():
        print(f"(no profile at {path})")
        return
    stats = pstats.Stats(str(path))
    stats.sort_stats("tottime").print_stats(top)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.overhead_probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="auto", help="whose tokenizer the gateway uses (see bench.serving_model)")
    p.add_argument("--streams", default="1,16", help="concurrent streams to measure, comma-separated")
    p.add_argument("--step-ms", type=float, default=20.0, help="the fake worker's step time")
    p.add_argument("--tokens", type=int, default=100, help="tokens per request")
    p.add_argument("--profile", action="store_true", help="run the gateway under cProfile (slower) and print it")
    p.add_argument("--json", metavar="PATH")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    model_dir = resolve_model(args.model)
    results = {"model_dir": str(model_dir), "micro": micro_costs(model_dir), "path": []}
    print("micro costs (median us per call):")
    for k, v in results["micro"].items():
        print(f"  {k:<40} {v:8.1f}")
    results["hops"] = {"zmq_ipc": measure_zmq(), "grpc_aio_stream": measure_grpc()}
    print("\ntransports alone, one-way between two processes, 1 message per 20 ms:")
    for k, v in results["hops"].items():
        print(f"  {k:<16} p50 {v['p50_ms']:.2f} ms  p90 {v['p90_ms']:.2f} ms  p99 {v['p99_ms']:.2f} ms")
    print(f"\ncluster path with a model-free worker (step {args.step_ms:g} ms, {args.tokens} tokens per request):")
    print("  streams  tok/s   worker-send -> client-receive ms p50 / p90 / p99   CPU us per token by process")
    for streams in (int(s) for s in args.streams.split(",")):
        profile_to = Path(f"/tmp/gateway-{streams}.prof") if args.profile else None
        row = path_latency(model_dir, streams, args.step_ms, args.tokens, profile_to)
        results["path"].append(row)
        cpu = ", ".join(f"{k} {v:.0f}" for k, v in row["cpu_us_per_token"].items())
        print(f"  {streams:>7}  {row['tokens_per_s']:6.0f}   {row['latency_ms_p50']:.2f} / {row['latency_ms_p90']:.2f}"
              f" / {row['latency_ms_p99']:.2f}{'':22}{cpu}; errors {row['errors'] or 0}; other processes "
              f"{100 * (row['foreign_share'] or 0):.0f}% of the CPU")
        if profile_to is not None:
            print_profile(profile_to)
    single = next((r for r in results["path"] if r["streams"] == 1), None)
    if single and single["latency_ms_p50"] is not None:
        hops = results["hops"]
        rest = single["latency_ms_p50"] - hops["zmq_ipc"]["p50_ms"] - hops["grpc_aio_stream"]["p50_ms"]
        results["gateway_internal_ms_p50_estimate"] = rest
        print(f"\n1 stream: path p50 {single['latency_ms_p50']:.2f} ms = ZeroMQ {hops['zmq_ipc']['p50_ms']:.2f} + "
              f"gRPC {hops['grpc_aio_stream']['p50_ms']:.2f} + the rest (gateway event loop, dispatcher, "
              f"detokenizer, client) {rest:.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
