"""Experiment 7: quantization (none / int8 / int4 / mixed) and the loading modes (full / sharded /
on demand) on the default model, the quantization benchmark's table plotted.

Owns only the selection and the figure: every variant is measured by bench/quantization.py, each
in a fresh process (peak memory and load time mean nothing in a process that loaded another).
"""

from __future__ import annotations

from bench.experiments import plotting
from bench.experiments.common import DEFAULT_MODEL_DIR, NUM_THREADS, Result
from bench.quantization import match_rate, measure_variants

NUMBER, NAME = 7, "quantization"
TITLE = "Quantization and loading modes"


def run(quick: bool = False) -> Result:
    results = measure_variants(DEFAULT_MODEL_DIR, threads=NUM_THREADS, quick=quick, max_wait=60)
    base = results["none"]
    rows, table = [], {}
    for name, r in results.items():
        identical, positions = match_rate(base["greedy"], r["greedy"])
        table[name] = {"weight_mib": r["weight_bytes"] / 2**20, "single_tok_s": r["single_tok_s"],
                       "batched_tok_s": r["batched_tok_s"], "perplexity": r.get("perplexity"),
                       "load_s": r.get("load_s"), "peak_rss_mib": r["rss_peak"] / 2**20,
                       "identical_prompts": identical, "matching_positions": positions}
        rows.append([name, table[name]["weight_mib"], r["weight_bytes"] / base["weight_bytes"],
                     r["single_tok_s"] / base["single_tok_s"], r["batched_tok_s"] / base["batched_tok_s"],
                     r.get("perplexity", float("nan")), f"{identical} / {len(base['greedy'])}",
                     f"{positions:.0%}"])
    int8, int4 = table.get("int8"), table.get("int4")
    headline = ("INT8 keeps {}/8 greedy prompts and {:.2f} perplexity (float {:.2f}) in {:.0%} of the weight "
                "bytes; INT4 {:.0%} of them at {:.2f}".format(
                    int8["identical_prompts"], int8["perplexity"], table["none"]["perplexity"],
                    int8["weight_mib"] / table["none"]["weight_mib"], int4["weight_mib"] / table["none"]["weight_mib"],
                    int4["perplexity"])) if int8 and int4 else "see the table"
    return Result(
        headers=["variant", "weights MiB", "x none", "1-stream tok/s x none", "batched tok/s x none", "perplexity",
                 "greedy prompts identical", "positions identical"],
        rows=rows, headline=headline, data={"variants": table, "measured": results},
        notes=["All weights measured are the model's as it computes (float32 on the CPU); embeddings and the "
               "output head stay float, and on this 4M-parameter model they are a third of the bytes."])


def plot(data: dict, path) -> None:
    variants = data["variants"]
    labels = [name.replace(", ", ",\n").replace(": ", ":\n") for name in variants]
    fig, axes = plotting.figure(3, "Experiment 7: quantization and loading modes (models/default)", width_in=6.5,
                                height_in=4.2)
    plotting.bars(axes[0], labels, [v["weight_mib"] for v in variants.values()], "weight MiB", fmt="{:.1f}")
    plotting.bars(axes[1], labels, [v["batched_tok_s"] for v in variants.values()], "batched tokens/s")
    plotting.bars(axes[2], labels, [v["perplexity"] or 0 for v in variants.values()], "held-out perplexity",
                  fmt="{:.2f}")
    low = min(v["perplexity"] for v in variants.values() if v["perplexity"])
    axes[2].set_ylim(low * 0.98, low * 1.02)
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=90, labelsize=7)
    plotting.save(fig, path)
