"""The structured-output benchmark's printed report (bench/structured_output.py): (1)'s arms, ratios,
validation and instrumented run, (2)'s mask tables and first-mask line, (3)'s compile table, and the
PASS/MISS line against THROUGHPUT_TARGET. Pure formatting: no measurement happens here."""

from __future__ import annotations

from bench.contention import FOREIGN_LOAD_WARN
from bench.report import table

THROUGHPUT_TARGET = 0.90  # B / C tokens/s


def print_report(r: dict, constrain_every: int) -> None:
    """`r` as bench/structured_output.py's main() builds it; `constrain_every` is its workload's
    (every Nth request constrained), which the results dict does not carry."""
    t = r.get("throughput")
    if t:
        print(f"\n(1) W1 on bench-small, {t['num_requests']} requests, every {constrain_every}th constrained "
              f"({len(t['constrained'])}), {r['threads']} torch threads, medians of {len(t['arms']['A']['steps'])} "
              "alternating rounds")
        names = {"A": "A  W1 unconstrained", "B": "B  W1, 1/4 constrained by W1_SCHEMA",
                 "C": "C  W1 unconstrained, B's lengths"}
        rows = []
        for arm in ("A", "B", "C"):
            a = t["arms"][arm]
            rows.append([names[arm], f"{a['tokens'][0]:,}", f"{a['wall_s']:.2f}", f"{a['tokens_per_s']:.1f}",
                         " / ".join(f"{x:.1f}" for x in a["rounds_tokens_per_s"]),
                         str(a["steps"][0]), f"{a['ms_per_step']:.2f}", f"{a['foreign_load_max']:.0%}"])
        print(table(rows, ["arm", "tokens", "wall s", "tok/s", "rounds", "steps", "ms/step", "other load"]))
        for key, ratio in t["ratios"].items():
            print(f"  {key}: {ratio['tokens_per_s']:.3f}x tok/s (rounds "
                  f"{' / '.join(f'{x:.3f}' for x in ratio['rounds'])}), {ratio['ms_per_step']:.3f}x ms/step")
        for i, v in enumerate(t["validation"]):
            print(f"  round {i + 1} B: {v['completed']}/{v['constrained']} constrained outputs completed, "
                  f"{v['valid']} parse and validate" + (f"; {v['failures'][:2]}" if v["failures"] else ""))
        if r["quick"]:
            print("  (--quick: outputs of 8-32 tokens are mostly too short to complete the schema)")
        print("  constrained lengths (max_tokens): " + ", ".join(
            f"#{i} {n} ({t['constrained_max_tokens'][i]})" for i, n in t["constrained_lengths"].items()))
        if max(t["arms"][a]["foreign_load_max"] for a in t["arms"]) > FOREIGN_LOAD_WARN:
            print(f"  NOTE other processes used > {FOREIGN_LOAD_WARN:.0%} of the CPU during some run")
        if t["length_drift"]:
            print(f"  NOTE lengths moved between rounds: {t['length_drift']}")
        s = t["instrumented_B"]
        print(f"  B instrumented: {s['wall_s']:.2f} s, {s['steps']} steps; mask_rows {s['mask_calls']} calls, "
              f"{s['mask_rows']} rows, {1e3 * s['mask_s']:.1f} ms ({1e3 * s['mask_s'] / max(1, s['mask_calls']):.3f}"
              f" ms a call, {1e3 * s['mask_s'] / max(1, s['mask_rows']):.3f} ms a row, {s['mask_s'] / s['wall_s']:.1%} of "
              f"the run); advance {s['advance_calls']} calls, "
              f"{1e3 * s['advance_s']:.1f} ms")
    for m in r.get("masks", []):
        print(f"\n(2) masks at {m['rows']} rows, {m['label']}, V = {m['vocab_size']:,}: ms over steps "
              f"{m['warmup_steps'] + 1}-{m['steps']} (median / p90 / max) and over the first {m['warmup_steps']} "
              "(median / max; the lexer's first visits)")
        rows = [[name, f"{m[key]['median_ms']:.3f}", f"{m[key]['p90_ms']:.3f}", f"{m[key]['max_ms']:.3f}",
                 f"{m['warmup'][key]['median_ms']:.3f}", f"{m['warmup'][key]['max_ms']:.3f}"]
                for name, key in (("mask_rows, 32 rows", "mask_rows"), ("  fill bitmasks (llguidance)", "fill"),
                                  ("  apply to the logits (numpy unpack, masked_fill_)", "apply"),
                                  ("llguidance's own apply kernel, for comparison", "apply_kernel"),
                                  ("mask_rows, 8 rows", "mask_rows_8"), ("mask_rows, 1 row", "mask_rows_1"),
                                  ("sampler, no constraints", "sampler_plain"),
                                  ("sampler, 32 constraints", "sampler_constrained"),
                                  ("advance 32 matchers a token", "advance"))]
        print(table(rows, ["", "median", "p90", "max", "first median", "first max"]))
    if r.get("first_mask"):
        print(f"\n  first mask of a process, [32, {r['first_mask_vocab']}]: " + "; ".join(
            f"{k}: " + (f"ours {1e3 * v['first_s']:.1f} ms, llguidance's kernel "
                        f"{v['llguidance_kernel_first_s']:.2f} s (torch.compile)" if "first_s" in v
                        else v["error"]) for k, v in r["first_mask"].items()))
    for c in r.get("compiles", []):
        print(f"\n(3) compile per schema, {c['label']}, V = {c['vocab_size']:,} (medians of {c['repeats']}; "
              f"tokenizer built once: gateway {c['gateway_tokenizer_ms']:.0f} ms, worker {c['worker_tokenizer_ms']:.0f} ms)")
        rows = [[s["schema"], f"{s['schema_bytes']:,}", f"{s['grammar_bytes']:,}", f"{s['gateway_check_ms']:.2f}",
                 f"{s['worker_cold_ms']:.2f}", f"{s['worker_cached_ms']:.3f}"] for s in c["schemas"]]
        print(table(rows, ["schema", "schema B", "grammar B", "gateway check ms", "worker cold ms",
                           "worker cached ms"]))
    if t:
        ratio = t["ratios"]["B/C"]["tokens_per_s"]
        print(f"\n{'PASS' if ratio >= THROUGHPUT_TARGET else 'MISS'}  B / C throughput {ratio:.3f}x "
              f"(target >= {THROUGHPUT_TARGET}x); B / A {t['ratios']['B/A']['tokens_per_s']:.3f}x"
              + ("  (--quick: one round of sub-second runs, not a measurement)" if r["quick"] else ""))
