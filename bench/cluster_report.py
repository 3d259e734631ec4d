"""The cluster-vs-engine benchmark's report: medians and ratios over repeats, its targets
(docs/benchmarks.md), and the printed tables. Pure arithmetic and printing over LoadResults; runs nothing."""

from __future__ import annotations

import statistics

from bench.load_stats import LoadResult
from bench.load_workload import LoadSpec

THROUGHPUT_TARGET = 0.90
ADDED_ITL_TARGET_MS = 2.0
FOREIGN_WARN = 0.10


def _ratio(a, b):
    return a / b if a is not None and b else None


def _diff(a, b):
    return a - b if a is not None and b is not None else None


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def overhead_facts(result: LoadResult) -> dict:
    """Per-request client-minus-gateway times (gRPC hop + client) and CPU per output token by process."""
    done = [r for r in result.records if r.ok and r.server_total_ms is not None]
    tokens = max(1, result.summary().output_tokens)
    cpu = result.extra.get("cpu", {})
    per_token = {name: s / tokens * 1e6 for name, s in cpu.get("cluster_cpu_s", {}).items()}
    per_token["client"] = cpu.get("client_cpu_s", 0.0) / tokens * 1e6
    return {
        "client_minus_gateway_ttft_ms_p50": _median([r.ttft_s * 1e3 - r.server_ttft_ms for r in done]),
        "client_minus_gateway_e2e_ms_p50": _median([r.e2e_s * 1e3 - r.server_total_ms for r in done]),
        "gateway_queue_ms_p50": _median([r.server_queue_ms for r in done]),
        "cpu_us_per_output_token": per_token,
        "foreign_share": cpu.get("foreign_share"),
    }


def compare(engine: LoadResult, cluster: LoadResult) -> dict:
    e, c = engine.summary(), cluster.summary()
    return {"throughput_ratio": _ratio(c.tokens_per_s, e.tokens_per_s),
            "added_itl_p50_ms": _diff(c.itl_ms[0], e.itl_ms[0]), "added_itl_p99_ms": _diff(c.itl_ms[1], e.itl_ms[1]),
            "added_ttft_p50_ms": _diff(c.ttft_ms[0], e.ttft_ms[0]),
            "added_tpot_p50_ms": _diff(c.tpot_ms_p50, e.tpot_ms_p50)}


def _f(x, fmt=".2f", none="-"):
    return none if x is None else format(x, fmt)


def print_report(results: dict) -> None:
    print("\n" + "=" * 100)
    print(f"model {results['model_dir']}  (vocab {results['vocab']}, context {results['context']}); "
          f"torch threads {results['threads']}; gateway stream_interval {results.get('stream_interval', 1)}; "
          f"machine: {results['cpus']} CPUs")
    cores = results.get("cores")
    print("cores: " + (", ".join(f"{role} {c}" for role, c in cores.items()) + " (engine side on the worker's, "
                       "load generator on the gateway's)" if cores else "not pinned"))
    for phase in results.get("runs", []):
        res: LoadResult = phase
        print()
        print(res.format())
        cpu = res.extra.get("cpu", {})
        fs = cpu.get("foreign_share")
        extra = {k: v for k, v in res.extra.items() if k != "cpu"}
        print(f"  {extra}; other processes used {_f(fs and 100 * fs, '.0f')}% of the CPU"
              + ("  ** measured under foreign load **" if fs and fs > FOREIGN_WARN else ""))
    cmp = results.get("compare")
    if cmp:
        a, b, s = cmp["throughput"], cmp["latency"], cmp["single"]
        pct = lambda x: _f(x and 100 * x, ".1f")
        each = lambda xs, fmt: ", ".join(_f(x, fmt) for x in xs)
        print(f"\n(c) cluster (1 worker) vs in-process engine; medians over {a['repeats']} alternating repeats "
              f"for (a) and (b')")
        print(f"  (a) closed loop: engine {_f(a['engine_tok_s'], '.1f')} tok/s, cluster "
              f"{_f(a['cluster_tok_s'], '.1f')} tok/s -> ratio {pct(a['throughput_ratio'])}% "
              f"(target >= {THROUGHPUT_TARGET:.0%}: {'met' if a['throughput_met'] else 'MISSED'}; per repeat "
              f"{each([x and 100 * x for x in a['pairwise_throughput_ratios']], '.1f')}%); "
              f"added ITL p50 {_f(a['added_itl_p50_ms'])} ms")
        print(f"  (b) Poisson {b['rate']:.2f} req/s: ITL p50 engine {_f(b['engine_itl_p50_ms'])} ms, cluster "
              f"{_f(b['cluster_itl_p50_ms'])} ms -> added {_f(b['added_itl_p50_ms'])} ms (target < "
              f"{ADDED_ITL_TARGET_MS:g} ms: {'met' if b['itl_met'] else 'MISSED'}); added TTFT p50 "
              f"{_f(b['added_ttft_p50_ms'])} ms, added ITL p99 {_f(b['added_itl_p99_ms'])} ms")
        print(f"  (b') one stream at a time: ITL p50 engine {_f(s['engine_itl_p50_ms'])} ms, cluster "
              f"{_f(s['cluster_itl_p50_ms'])} ms -> added {_f(s['added_itl_p50_ms'])} ms (target < "
              f"{ADDED_ITL_TARGET_MS:g} ms: {'met' if s['itl_met'] else 'MISSED'}; per repeat "
              f"{each(s['pairwise_added_itl_p50_ms'], '.2f')}); throughput ratio {pct(s['throughput_ratio'])}%")
        for key in ("throughput", "latency", "single"):
            o = cmp[key]["overhead"]
            cpu = ", ".join(f"{k} {v:.0f}" for k, v in o["cpu_us_per_output_token"].items())
            print(f"  cluster {key} run: client-minus-gateway p50 TTFT {_f(o['client_minus_gateway_ttft_ms_p50'])}"
                  f" ms, E2E {_f(o['client_minus_gateway_e2e_ms_p50'])} ms; CPU us per output token: {cpu} "
                  f"(engine in-process: {cmp[key]['engine_cpu_us_per_token']:.0f})")
    pri = results.get("priority")
    if pri:
        print(f"\n(d) saturated mixed workload, Poisson {pri['rate']:.2f} req/s, worker max_num_seqs "
              f"{pri['max_num_seqs']}, 1 worker")
        print("  policy     urgent TTFT p50/p99 ms   bulk TTFT p50/p99 ms   urgent E2E p99 s  bulk tok/s  "
              "total tok/s  queue max")
        for policy, row in pri["policies"].items():
            urgent = f"{_f(row['urgent_ttft_p50_ms'], '.0f'):>9} / {_f(row['urgent_ttft_p99_ms'], '.0f'):<9}"
            print(f"  {policy:<9}  {urgent}"
                  f"  {_f(row['bulk_ttft_p50_ms'], '.0f'):>9} / {_f(row['bulk_ttft_p99_ms'], '.0f'):<9}"
                  f"  {_f(row['urgent_e2e_p99_s']):>14}  {_f(row['bulk_tok_s'], '.1f'):>10}"
                  f"  {_f(row['total_tok_s'], '.1f'):>11}  {row['queue_depth_max']}")
        print(f"  urgent p99 TTFT, fifo / priority: {_f(pri['urgent_p99_ttft_fifo_over_priority'], '.1f')}x")


def representative(runs: list[LoadResult]) -> LoadResult:
    """The repeat with the median output tokens/s (the lower middle one for an even count)."""
    return sorted(runs, key=lambda r: r.summary().tokens_per_s)[(len(runs) - 1) // 2]


def summarize_compare(phases: dict) -> dict:
    """Medians over repeats per side; ratios and differences of those medians."""
    out = {}
    for key in ("throughput", "latency", "single"):
        e_runs, c_runs = phases[key]["engine"], phases[key]["cluster"]
        med = lambda runs, f: statistics.median(x for x in (f(r.summary()) for r in runs) if x is not None)
        e_tok, c_tok = med(e_runs, lambda s: s.tokens_per_s), med(c_runs, lambda s: s.tokens_per_s)
        e_itl, c_itl = med(e_runs, lambda s: s.itl_ms[0]), med(c_runs, lambda s: s.itl_ms[0])
        e_rep, c_rep = representative(e_runs), representative(c_runs)
        engine_cpu = e_rep.extra["cpu"]["client_cpu_s"] / max(1, e_rep.summary().output_tokens) * 1e6
        out[key] = {**compare(e_rep, c_rep), "repeats": len(e_runs),
                    "engine_tok_s": e_tok, "cluster_tok_s": c_tok, "throughput_ratio": _ratio(c_tok, e_tok),
                    "pairwise_throughput_ratios": [_ratio(c.summary().tokens_per_s, e.summary().tokens_per_s)
                                                   for e, c in zip(e_runs, c_runs)],
                    "engine_itl_p50_ms": e_itl, "cluster_itl_p50_ms": c_itl, "added_itl_p50_ms": c_itl - e_itl,
                    "pairwise_added_itl_p50_ms": [_diff(c.summary().itl_ms[0], e.summary().itl_ms[0])
                                                  for e, c in zip(e_runs, c_runs)],
                    "engine_cpu_us_per_token": engine_cpu, "overhead": overhead_facts(c_rep)}
    out["throughput"]["throughput_met"] = (out["throughput"]["throughput_ratio"] or 0) >= THROUGHPUT_TARGET
    out["latency"]["rate"] = phases["latency_spec"].rate
    out["latency"]["itl_met"] = out["latency"]["added_itl_p50_ms"] < ADDED_ITL_TARGET_MS
    out["single"]["itl_met"] = out["single"]["added_itl_p50_ms"] < ADDED_ITL_TARGET_MS
    return out


def summarize_priority(runs: dict[str, LoadResult], rate: float, max_num_seqs: int, spec: LoadSpec) -> dict:
    policies = {}
    for policy, res in runs.items():
        by_p = res.by_priority()
        urgent, bulk = by_p.get(spec.urgent_priority), by_p.get(spec.bulk_priority)
        policies[policy] = {
            "urgent_ttft_p50_ms": urgent and urgent.ttft_ms[0], "urgent_ttft_p99_ms": urgent and urgent.ttft_ms[1],
            "bulk_ttft_p50_ms": bulk and bulk.ttft_ms[0], "bulk_ttft_p99_ms": bulk and bulk.ttft_ms[1],
            "urgent_e2e_p99_s": urgent and urgent.e2e_s[1], "bulk_tok_s": bulk and bulk.tokens_per_s,
            "total_tok_s": res.summary().tokens_per_s, "queue_depth_max": res.extra.get("queue_depth_max"),
            "errors": res.summary().errors}
    p99 = lambda name: policies.get(name, {}).get("urgent_ttft_p99_ms")
    return {"rate": rate, "max_num_seqs": max_num_seqs, "policies": policies,
            "urgent_p99_ttft_fifo_over_priority": _ratio(p99("fifo"), p99("priority"))}
