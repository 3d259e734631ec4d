"""The HTTP-against-gRPC benchmark's numbers (bench/http_vs_grpc.py): each side's medians over its rounds, the
comparisons between sides, the targets, the gateway's cProfile digest, and the printed report. Pure computation and
formatting: no measurement happens here."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from bench.load_stats import LoadResult

THROUGHPUT_TARGET = 0.90
ADDED_ITL_TARGET_MS = 1.0


# Not the request path: waiting in epoll, and the gateway's start-up (imports, compiling, loading the tokenizer).
_IDLE_OR_START = ("'poll' of 'select.epoll'", "marshal.loads", "builtins.compile", "builtins.exec", "__build_class__",
                  "_imp.create_", "'read' of '_io.BufferedReader'", "from_file", "posix.stat", "re/_", "sre_",
                  "importlib")


def busy_profile(stats, tokens: int, name: str, top: int = 20) -> str:
    """The gateway's busy functions by own time, in microseconds per output token."""
    rows, busy = [], 0.0
    for (filename, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        where = f"{filename}:{line}({func})" if line else func
        if any(p in where for p in _IDLE_OR_START):
            continue
        busy += tottime
        rows.append((tottime, ncalls, cumtime, where.replace(str(Path(sys.prefix)), "<venv>")))
    rows.sort(reverse=True)
    n = max(1, tokens)
    lines = [f"{name}: gateway busy {busy / n * 1e6:.0f} us per output token ({tokens} tokens, cProfile's own "
             f"overhead included); top functions by own time:",
             f"  {'us/token':>9} {'calls/token':>11} {'cum us/token':>12}  function"]
    for tottime, ncalls, cumtime, where in rows[:top]:
        lines.append(f"  {tottime / n * 1e6:9.1f} {ncalls / n:11.2f} {cumtime / n * 1e6:12.1f}  {where[-110:]}")
    return "\n".join(lines)


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def side_summary(results: list[LoadResult]) -> dict:
    """Medians over a side's rounds, with each round's throughput."""
    sums = [r.summary() for r in results]
    tokens = [max(1, s.output_tokens) for s in sums]
    cpu = [r.extra.get("cpu", {}) for r in results]
    per_token = {}
    for name in sorted({k for c in cpu for k in c.get("cluster_cpu_s", {})}):
        per_token[name] = _median([c.get("cluster_cpu_s", {}).get(name, 0.0) / n * 1e6 for c, n in zip(cpu, tokens)])
    per_token["client"] = _median([c.get("client_cpu_s", 0.0) / n * 1e6 for c, n in zip(cpu, tokens)])
    return {"tokens_per_s": _median([s.tokens_per_s for s in sums]),
            "rounds_tokens_per_s": [s.tokens_per_s for s in sums],
            "completed": [s.completed for s in sums], "requests": [s.requests for s in sums],
            "errors": [s.errors for s in sums],
            "resent_after_drop": sum(len(r.extra.get("resent_after_drop", [])) for r in results),
            "ttft_ms_p50": _median([s.ttft_ms[0] for s in sums]), "ttft_ms_p99": _median([s.ttft_ms[1] for s in sums]),
            "itl_ms_p50": _median([s.itl_ms[0] for s in sums]), "itl_ms_p99": _median([s.itl_ms[1] for s in sums]),
            "e2e_s_p50": _median([s.e2e_s[0] for s in sums]),
            "path_ms_p50": _median([r.extra.get("path_ms", {}).get("p50") for r in results]),
            "path_ms_p99": _median([r.extra.get("path_ms", {}).get("p99") for r in results]),
            "cpu_us_per_token": per_token,
            "foreign_share_max": max((c.get("foreign_share", 0.0) for c in cpu), default=0.0)}


def _ratio(a, b):
    return a / b if a is not None and b else None


def _diff(a, b):
    return a - b if a is not None and b is not None else None


def compare(sides: dict[str, dict], base: str, other: str) -> dict:
    b, o = sides[base], sides[other]
    rounds = [_ratio(x, y) for x, y in zip(o["rounds_tokens_per_s"], b["rounds_tokens_per_s"])]
    return {"throughput_ratio": _ratio(o["tokens_per_s"], b["tokens_per_s"]), "rounds_ratio": rounds,
            "added_itl_p50_ms": _diff(o["itl_ms_p50"], b["itl_ms_p50"]),
            "added_itl_p99_ms": _diff(o["itl_ms_p99"], b["itl_ms_p99"]),
            "added_ttft_p50_ms": _diff(o["ttft_ms_p50"], b["ttft_ms_p50"]),
            "added_path_p50_ms": _diff(o["path_ms_p50"], b["path_ms_p50"])}


def _f(x, fmt=".2f"):
    return "-" if x is None else format(x, fmt)


def print_report(report: dict) -> None:
    """Everything bench/http_vs_grpc.py prints: the profiles (--profile), the table of sides, the comparisons, the
    targets, the workloads, and how busy the CPU was."""
    for text in report["profiles"].values():
        print(text)
    print("\n" + "=" * 110)
    print(f"model {report['model_dir']}; client {report['client']}; concurrency {report['concurrency']}; "
          f"{report['cpus']} CPUs; cores {report['cores'] or 'unpinned'}")
    header = ("phase", "side", "out tok/s (rounds)", "TTFT p50/p99 ms", "ITL p50/p99 ms", "path p50/p99 ms",
              "CPU us/tok gateway / client / server", "done", "other load")
    rows = [header]
    for phase, sides in report["phases"].items():
        for name, s in sides.items():
            cpu = s["cpu_us_per_token"]
            server = cpu.get("worker-0") if name != "llama-server" else cpu.get("llama-server")
            rounds = " / ".join(f"{x:.0f}" for x in s["rounds_tokens_per_s"])
            rows.append((phase, name, f"{s['tokens_per_s']:.1f} ({rounds})",
                         f"{_f(s['ttft_ms_p50'], '.1f')} / {_f(s['ttft_ms_p99'], '.1f')}",
                         f"{_f(s['itl_ms_p50'])} / {_f(s['itl_ms_p99'])}",
                         f"{_f(s['path_ms_p50'])} / {_f(s['path_ms_p99'])}",
                         f"{_f(cpu.get('gateway') if name != 'llama-server' else None, '.0f')} / "
                         f"{_f(cpu.get('client'), '.0f')} / {_f(server, '.0f')}",
                         f"{min(s['completed'])}/{s['requests'][0]}"
                         + (f" ({s['resent_after_drop']} resent)" if s["resent_after_drop"] else ""),
                         f"{s['foreign_share_max']:.0%}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print()
    for name, c in report["comparisons"].items():
        rounds = " / ".join(f"{x:.1%}" for x in c["rounds_ratio"] if x is not None)
        print(f"{name}: throughput {_f(c['throughput_ratio'] and 100 * c['throughput_ratio'], '.1f')}% ({rounds}); "
              f"added ITL p50 {_f(c['added_itl_p50_ms'], '+.2f')} ms, p99 {_f(c['added_itl_p99_ms'], '+.2f')} ms; "
              f"added TTFT p50 {_f(c['added_ttft_p50_ms'], '+.1f')} ms"
              + (f"; added path p50 {_f(c['added_path_p50_ms'], '+.2f')} ms" if c["added_path_p50_ms"] is not None
                 else ""))
    if report.get("llama_skipped"):
        print(f"(c) llama-server skipped: {report['llama_skipped']}")
    print()
    for t in report["targets"]:
        print(f"target {t['target']}: {t['measured']} -> {'met' if t['met'] else 'MISSED'}")
    for name, text in report["specs"].items():
        print(f"workload {name}: {text}")
    print(f"busy before: {report['busy_before'] or 'none'}; after: {report['busy_after'] or 'none'}; "
          f"total {report['total_s']:.0f} s")


def targets(comparisons: dict) -> list[dict]:
    out = []
    for name in ("(a) HTTP / gRPC, fake worker", "(b) HTTP / gRPC, bench-small"):
        c = comparisons.get(name)
        if c is None:
            continue
        ratio, added = c["throughput_ratio"], c["added_itl_p50_ms"]
        out.append({"target": f"{name}: throughput >= {THROUGHPUT_TARGET:.0%}", "measured": f"{100 * ratio:.1f}%",
                    "met": ratio is not None and ratio >= THROUGHPUT_TARGET})
        out.append({"target": f"{name}: added ITL p50 < {ADDED_ITL_TARGET_MS:g} ms", "measured": f"{added:+.2f} ms",
                    "met": added is not None and added < ADDED_ITL_TARGET_MS})
    c = comparisons.get("(a') HTTP / gRPC, fake worker, one stream")
    if c is not None:
        added = c["added_itl_p50_ms"]
        out.append({"target": f"(a') one stream: added ITL p50 < {ADDED_ITL_TARGET_MS:g} ms",
                    "measured": f"{added:+.2f} ms", "met": added is not None and added < ADDED_ITL_TARGET_MS})
    return out
