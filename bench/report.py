"""Formats the benchmark's results dict: the side-by-side table, the bound, decode and KV-utilisation lines, and one
PASS/MISS line per target. Pure formatting: no measurement happens here."""

from __future__ import annotations

from dataclasses import dataclass

from bench.contention import FOREIGN_LOAD_WARN

TARGET_VS_STATIC = 2.0
TARGET_VS_HF_CB = 1.5
TARGET_COMPUTE_FRACTION = 0.5
TARGET_DECODE_VS_HF = 1.2
TARGET_BANDWIDTH_FRACTION = 0.6
TARGET_KV_UTILISATION = 0.9

NAMES = {"hf_static": "(a) HF generate (static batch)", "hf_continuous_batching": "(b) HF continuous batching",
         "ours": "(c) our engine"}


@dataclass
class Target:
    name: str
    value: float | None  # None: could not be measured
    goal: float
    percent: bool = False
    why_missing: str | None = None
    baseline_missing: bool = False  # the comparison has nothing to compare against: SKIP rather than MISS

    @property
    def status(self) -> str:
        if self.value is None:
            return "SKIP" if self.baseline_missing else "MISS"
        return "PASS" if self.value >= self.goal else "MISS"

    def line(self) -> str:
        fmt = pct if self.percent else times
        why = (self.why_missing or "unknown")[:70]
        got = fmt(self.value) if self.value is not None else f"not measured ({why})"
        return f"{self.status:4s}  {self.name:<48s} {got:>8s}   target >= {fmt(self.goal)}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]

    def fmt(r):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])


def targets(r: dict) -> list[Target]:
    sysd, ra, d, kv, why = r["systems"], r["ratios"], r["decode"], r["kv"], r["why_missing"]

    def vs(baseline_key: str, value, goal, name):
        if sysd[baseline_key] is None:
            return Target(name, None, goal, why_missing=f"baseline {why.get(baseline_key, 'missing')}",
                          baseline_missing=True)
        return Target(name, value, goal, why_missing=why.get("ours"))

    out = [vs("hf_static", ra["ours_vs_hf_static"], TARGET_VS_STATIC, "(c) vs (a) HF static generate, useful tok/s"),
           vs("hf_continuous_batching", ra["ours_vs_hf_cb"], TARGET_VS_HF_CB, "(c) vs (b) HF continuous batching"),
           Target("(c) fraction of the compute bound", (sysd["ours"] or {}).get("compute_bound_fraction"),
                  TARGET_COMPUTE_FRACTION, percent=True, why_missing=why.get("ours"))]
    if d["hf"] is None:
        out.append(Target("single-stream decode vs HF generate", None, TARGET_DECODE_VS_HF,
                          why_missing=f"baseline {why.get('hf_decode')}", baseline_missing=True))
    else:
        out.append(Target("single-stream decode vs HF generate", d["ratio"], TARGET_DECODE_VS_HF,
                          why_missing=why.get("ours_decode")))
    out.append(Target("single-stream decode fraction of bandwidth bound", d["ours_bandwidth_fraction"],
                      TARGET_BANDWIDTH_FRACTION, percent=True, why_missing=why.get("ours_decode")))
    out.append(Target("KV-slot utilisation (paged, live / allocated)", kv and kv["paged_utilisation"],
                      TARGET_KV_UTILISATION, percent=True, why_missing=why.get("kv")))
    return out


def _header(r: dict) -> None:
    m, w, es, hwd = r["model"], r["workload"], r["engine_settings"], r["hardware"]
    load = hwd["foreign_cpu_share_by_phase"]
    print(f"bench-small: {m['params'] / 1e6:.1f}M params (block linears {m['block_linear_params'] / 1e6:.1f}M, "
          f"LM head {m['lm_head_params'] / 1e6:.1f}M), float32, {m['threads']} torch threads")
    print(f"workload: {w['num_requests']} requests, prompts {w['prompt_len_range'][0]}..{w['prompt_len_range'][1]} "
          f"({w['prompt_tokens']} tokens), outputs {w['output_len_range'][0]}..{w['output_len_range'][1]} "
          f"({w['output_tokens']} tokens, EOS ignored), random prompt ids, greedy, seeded")
    print(f"engine: num_kv_blocks={es['num_kv_blocks']} block_size={es['block_size']} "
          f"max_num_seqs={es['max_num_seqs']} max_num_batched_tokens={es['max_num_batched_tokens']} "
          f"prefix caching off")
    for when in ("before", "after"):
        busy = hwd[f"busy_other_processes_{when}"]
        if busy:
            print(f"WARNING: other processes were using the CPU {when} the run: " + "; ".join(busy))
    noisy = [k for k, v in load.items() if v > FOREIGN_LOAD_WARN]
    if noisy:
        print(f"WARNING: other processes used > {FOREIGN_LOAD_WARN:.0%} of the CPU during: {', '.join(noisy)} "
              f"(see 'other load'); those measurements are unreliable")


def _bounds(r: dict) -> None:
    m, w, hwd, bd = r["model"], r["workload"], r["hardware"], r["bounds"]
    load, f = hwd["foreign_cpu_share_by_phase"], bd["workload_flops"]
    shapes = ", ".join(f"{k} {v:.0f}" for k, v in hwd["matmul_per_shape_gflops"].items())
    rounds = " / ".join(f"{mm['gflops']:.1f}" for mm, _ in hwd["rounds"])
    print(f"matmul rate: {hwd['matmul_gflops']:.1f} GFLOP/s float32 = the best shape's median torch.mm time (15 "
          f"runs), better of 2 rounds (start / end of run: {rounds}); per shape: {shapes}")
    rounds = " / ".join(f"{c:.1f}" for _, c in hwd["rounds"])
    print(f"copy bandwidth: {hwd['copy_gbps']:.1f} GB/s = median of 7 copies of a 256 MiB float32 tensor, bytes "
          f"read + written, better of 2 rounds ({rounds}); other load while measuring: "
          f"{pct(load.get('bounds'))} / {pct(load.get('bounds_end'))}")
    print("workload FLOPs = sum over requests of [2 x N_block x (P + O - 1)  +  sum over those P + O - 1 processed "
          "tokens of 4 x ctx x hidden x layers  +  2 x hidden x vocab x O]")
    print(f"  N_block = {m['block_linear_params'] / 1e6:.2f}M non-embedding matmul params (q,k,v,o,gate,up,down); "
          f"ctx = position + 1 (causal QK^T and PV); LM head only for the O generated tokens")
    print(f"  = {f['total'] / 1e9:.1f} GFLOP (block linears {f['linear'] / 1e9:.1f} + attention "
          f"{f['attention'] / 1e9:.1f} + LM head {f['lm_head'] / 1e9:.1f}); compute bound "
          f"{bd['compute_bound_s']:.2f} s = {w['output_tokens'] / bd['compute_bound_s']:.0f} useful tok/s")
    if bd.get("ours_compute_bound_s") and bd["ours_compute_bound_s"] != bd["compute_bound_s"]:
        print(f"  (c) is taken against the matmul rate measured around each of its own runs (the rate moves by "
              f"a third over minutes on this VM): bound {bd['ours_compute_bound_s']:.2f} s for the reported run")


def _throughput(r: dict) -> None:
    load, why = r["hardware"]["foreign_cpu_share_by_phase"], r["why_missing"]
    rows, notes = [], []
    for key, name in NAMES.items():
        s = r["systems"][key]
        if s is None:
            rows.append([name, "-", "-", "-", "-", "-"])
            notes.append(f"{name[:3]} not measured: {why.get(key, 'unknown')}")
        else:
            rows.append([name, num(s["wall_s"], 2), str(s["useful_tokens"]), num(s["tokens_per_s"]),
                         pct(s["compute_bound_fraction"]), pct(load.get(key))])
            notes += [f"{name[:3]} {n}" for n in s["notes"]]
    print(table(rows, ["system", "wall s", "useful tok", "useful tok/s", "of compute bound", "other load"]))
    for n in notes:
        print(n)
    ra = r["ratios"]
    print(f"(c)/(a) = {times(ra['ours_vs_hf_static'])}   (c)/(b) = {times(ra['ours_vs_hf_cb'])}   (useful tok/s)")
    cbs = r["hf_cb_settings"]
    print(f"(a) setup: model.generate on batches of {r['static_batch_size']} in arrival order, left padding + "
          f"attention_mask, max_new_tokens = min_new_tokens = the batch's longest output; attn=sdpa")
    if why.get("hf_continuous_batching") != "skipped":
        print(f"(b) setup: ContinuousBatchingManager.add_request per request with its own max_new_tokens and "
              f"eos_token_id=-1 (generate_batch takes one max_new_tokens for all); "
              f"attn={cbs['attn_implementation']}, page_size={cbs['page_size']}, "
              f"max_batch_tokens={cbs['max_batch_tokens']}, max_requests_per_batch={cbs['max_requests_per_batch']}, "
              f"cache sized to hold every request, no prefix sharing, no CUDA graphs/compile")
    ag = r["agreement"]
    print(f"greedy agreement: ours vs (a) {ag['ours_vs_hf_static']}; ours vs (b) {ag['ours_vs_hf_cb']}; "
          f"(b) vs (a) {ag['hf_cb_vs_hf_static']}")


def _decode(r: dict) -> None:
    d, bd, hwd = r["decode"], r["bounds"], r["hardware"]
    load = hwd["foreign_cpu_share_by_phase"]
    n = (d["hf"] or d["ours"] or {}).get("new_tokens", "?")
    print(f"single-stream decode (prompt 128, {n} decode steps, greedy, ignore_eos; rate = n / (t(n+1 tokens) - "
          f"t(1 token)), medians of {r['decode_repeats']} runs):")
    for label, key in (("HF generate batch 1", "hf"), ("our engine", "ours")):
        x = d[key]
        print(f"  {label:<20s} " + (f"not measured ({r['why_missing'].get(key + '_decode', 'unknown')})"
                                    if x is None else
              f"{x['tokens_per_s']:.1f} tok/s  (t1 {x['t_first_s']:.3f}s, t{x['new_tokens'] + 1} "
              f"{x['t_full_s']:.3f}s)  = {pct(d[key + '_bandwidth_fraction'])} of bandwidth bound; "
              f"other load {pct(load.get(key + '_decode'))}"))
    print(f"  our engine / HF = {times(d['ratio'])}")
    print(f"  bandwidth bound: {bd['decode_bytes_per_token'] / 1e6:.1f} MB of weights per token (block linears + "
          f"LM head, not the embedding table) / {hwd['copy_gbps']:.1f} GB/s = "
          f"{bd['decode_bound_tokens_per_s']:.1f} tok/s")


def _kv(r: dict) -> None:
    kv = r["kv"]
    if kv is None:
        print(f"KV-slot utilisation: not measured ({r['why_missing'].get('kv', 'unknown')})")
        return
    print(f"KV-slot utilisation of (c), workload driven by add_request/step, engine.kv_usage() sampled after each "
          f"of {kv['steps']} steps ({kv['wall_s']:.2f}s):")
    rows = [("paged (sum live / sum allocated slots)", kv["paged_utilisation"]),
            (f"contiguous, each unfinished request reserving max_model_len={kv['max_model_len']}",
             kv["contiguous_max_len_utilisation"]),
            ("contiguous, each unfinished request reserving its prompt+max_tokens",
             kv["contiguous_exact_reservation_utilisation"])]
    for label, value in rows:
        print(f"  {label + ':':<72s} {pct(value):>6s}")
    print("  (same per-step live counts; every request arrives at t=0 and max_num_seqs >= requests, so a contiguous "
          "allocator holds a reservation for every unfinished request)")


def print_report(r: dict) -> None:
    for section in (_header, _bounds, _throughput, _decode, _kv):
        print()
        section(r)
    if r["errors"]:
        print()
        for k, v in r["errors"].items():
            print(f"error in {k}: {v}")
    print()
    for t in targets(r):
        print(t.line())
    print(f"total benchmark time {r['total_s']:.0f}s")
