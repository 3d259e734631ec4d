"""The routing benchmark's numbers (bench/routing.py): one run's summary, the ratios against the
targets, and the printed table. Pure computation and formatting: no measurement happens here."""
from __future__ import annotations

from collections import Counter

from bench.load_stats import Summary
from bench.report import Target, num, pct, table
from bench.routing_workload import WORKLOADS

TARGET_HIT_VS_SINGLE = 0.90  # cache_aware's hit rate / one worker's with the whole cache (multi-turn)
TARGET_TTFT_LL_VS_CA = 1.5  # least_loaded's TTFT p50 / cache_aware's (multi-turn)
TARGET_THROUGHPUT_CA_VS_LL = 0.95  # cache_aware's requests/s / least_loaded's (no-sharing)
MULTI_TURN = ("multi_turn", "multi_turn_think")


def summarize(records: list, wall_s: float, counters: dict[str, float], acct: dict) -> dict:
    """One (cluster, policy, workload) run: hit rate, latency, throughput and where requests went."""
    s = Summary.of(records, wall_s)
    done = [r for r in records if r.ok]
    prompt = sum(r.prompt_len for r in done)
    cached = sum(r.cached_tokens for r in done)
    workers_of: dict[int, set[str]] = {}
    for r in done:
        workers_of.setdefault(r.conversation, set()).add(r.worker_id)
    turns = sorted({r.turn for r in done})
    by_turn = {t: [r for r in done if r.turn == t] for t in turns}
    queries = counters.get("inference_prefix_cache_queries_total", 0.0)
    return {
        "requests": s.requests, "completed": s.completed, "errors": s.errors, "wall_s": wall_s,
        "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0,
        # The workers' own counters: hits over the tokens they could have reused (all but each last token's block).
        "worker_hit_rate": counters.get("inference_prefix_cache_hits_total", 0.0) / queries if queries else None,
        "ttft_ms_p50": s.ttft_ms[0], "ttft_ms_p99": s.ttft_ms[1], "itl_ms_p50": s.itl_ms[0],
        "e2e_s_p50": s.e2e_s[0], "requests_per_s": s.requests_per_s, "tokens_per_s": s.tokens_per_s,
        "hit_rate_by_turn": {t: sum(r.cached_tokens for r in rs) / max(1, sum(r.prompt_len for r in rs))
                             for t, rs in by_turn.items()},
        "ttft_ms_p50_by_turn": {t: Summary.of(rs, wall_s).ttft_ms[0] for t, rs in by_turn.items()},
        "workers_per_conversation": (sum(len(w) for w in workers_of.values()) / len(workers_of)
                                     if workers_of else None),
        "requests_per_worker": dict(sorted(Counter(r.worker_id for r in done).items())),
        "counters": counters, "foreign_share": acct.get("foreign_share"),
        "cluster_cpu_s": sum(acct.get("cluster_cpu_s", {}).values()), "client_cpu_s": acct.get("client_cpu_s"),
    }


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def ratios(runs: dict[str, dict]) -> dict:
    def get(run: str, workload: str, key: str):
        return runs.get(run, {}).get(workload, {}).get(key)

    out = {}
    for workload in MULTI_TURN:
        out[f"hit_cache_aware_vs_single/{workload}"] = _ratio(get("cache_aware", workload, "hit_rate"),
                                                              get("single_worker", workload, "hit_rate"))
        out[f"ttft_p50_least_loaded_vs_cache_aware/{workload}"] = _ratio(
            get("least_loaded", workload, "ttft_ms_p50"), get("cache_aware", workload, "ttft_ms_p50"))
    out["throughput_cache_aware_vs_least_loaded/no_sharing"] = _ratio(
        get("cache_aware", "no_sharing", "requests_per_s"), get("least_loaded", "no_sharing", "requests_per_s"))
    return out


def targets(cluster: dict) -> list[Target]:
    r, name, out = cluster["ratios"], cluster["name"], []
    for workload in MULTI_TURN:
        out += [Target(f"{name}, {workload}: cache_aware hit rate / one worker's",
                       r[f"hit_cache_aware_vs_single/{workload}"], TARGET_HIT_VS_SINGLE, why_missing="not run"),
                Target(f"{name}, {workload}: least_loaded TTFT p50 / cache_aware's",
                       r[f"ttft_p50_least_loaded_vs_cache_aware/{workload}"], TARGET_TTFT_LL_VS_CA,
                       why_missing="not run")]
    out.append(Target(f"{name}, no_sharing: cache_aware / least_loaded req/s",
                      r["throughput_cache_aware_vs_least_loaded/no_sharing"], TARGET_THROUGHPUT_CA_VS_LL,
                      why_missing="not run"))
    return [t for t in out if t.value is not None]


def _outcomes(counters: dict[str, float]) -> str:
    prefix = "inference_routing_decisions_total{"
    parts = [f"{k[len(prefix):-1]} {v:.0f}" for k, v in counters.items() if k.startswith(prefix)]
    return ", ".join(parts) or "-"


def rows(cluster: dict) -> list[list[str]]:
    out = []
    for workload in WORKLOADS:
        for run, by_workload in cluster["runs"].items():
            s = by_workload.get(workload)
            if s is None:
                continue
            out.append([cluster["name"], workload, run, f"{s['completed']}/{s['requests']}", pct(s["hit_rate"]),
                        num(s["ttft_ms_p50"], 0), num(s["ttft_ms_p99"], 0), num(s["requests_per_s"], 2),
                        num(s["tokens_per_s"], 0), num(s["workers_per_conversation"], 2), pct(s["foreign_share"]),
                        _outcomes(s["counters"])])
    return out


HEADER = ["cluster", "workload", "policy", "done", "hit rate", "TTFT p50 ms", "TTFT p99 ms", "req/s", "out tok/s",
          "workers/conv", "other load", "routing decisions"]


def print_report(report: dict) -> None:
    print(f"bench.routing {report['date']} commit {report['commit']}: {report['command']}")
    for cluster in report["clusters"]:
        spec, fake = cluster["spec"], cluster["fake_workers"]
        workers = (f"fake workers: {fake['step_ms']:g} ms/token, prefill {fake['prefill_us_per_token']:g} us per "
                   f"uncached token, {fake['cache_blocks']} blocks each" if fake else
                   f"real workers, {cluster['worker_section']}")
        print(f"{cluster['name']}: {spec['num_conversations']} conversations x {spec['num_turns']} turns at "
              f"{spec['rate']:g}/s (think time {spec['think_s']:g} s in multi_turn_think); {workers}; the "
              f"one-worker baseline holds {cluster['num_workers']}x the cache")
    all_rows = [row for cluster in report["clusters"] for row in rows(cluster)]
    if all_rows:
        print(table(all_rows, HEADER))
    for name, why in report.get("skipped", {}).items():
        print(f"{name}: skipped ({why})")
    print()
    for cluster in report["clusters"]:
        for target in targets(cluster):
            print(target.line())
    print(f"({report.get('total_s', 0):.0f} s in all)")
