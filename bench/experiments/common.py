"""What every experiment shares: the result record, markdown tables, the models they run on, and
small engine helpers (building one, counting the tokens a step computes, timing with the clock).

It owns no experiment logic and never edits the engine's code: helpers only wrap instance
attributes of an engine they were handed.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.checkpoints import REPO_ROOT

DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "default"
LONG_MODEL_DIR = REPO_ROOT / ".cache" / "experiments" / "default-ctx2048"
LONG_CONTEXT = 2048
# Torch threads of every in-process engine: the development machine's 2 cores. The runner's --threads
# changes it (1 keeps timings sane while a neighbour holds a core: a descheduled OpenMP partner
# stalls every 2-thread region).
NUM_THREADS = int(os.environ.get("EXPERIMENTS_THREADS", "2"))
FIRST_ORDINARY_ID = 8  # prompt ids clear of the specials (bench/load_workload.py uses the same)


@dataclass
class Result:
    """One experiment's outcome: a table for the docs, a one-line headline, and the data its plot reads."""
    headers: list[str]
    rows: list[list]
    headline: str
    data: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        return markdown_table(self.headers, self.rows)

    def to_dict(self) -> dict:
        return {"headers": self.headers, "rows": self.rows, "headline": self.headline, "notes": self.notes,
                "data": self.data}


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


_NUMBER_TEXT = re.compile(r"^[-+]?[\d,.]+(%|x)?( / [\d,.]+)?$")  # "45.2%", "3.10x", "12 / 40"


def _is_number(value) -> bool:
    if isinstance(value, str):
        return bool(_NUMBER_TEXT.match(value))
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def pct(x: float) -> str:
    return f"{x:.1%}"


def times(x: float) -> str:
    return f"{x:.2f}x"


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """Text columns left-aligned, numeric ones right-aligned (judged from the first row)."""
    numeric = [bool(rows) and all(_is_number(row[i]) for row in rows) for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def long_context_model() -> Path:
    """models/default's weights and tokenizer behind a config whose context is 2048 instead of 512.

    Rotary positions have no learned table, so the same weights run at any length; past 512 tokens
    the text is meaningless, but every experiment that uses this measures cost (tokens, time,
    memory), which depends only on the shapes."""
    target = LONG_MODEL_DIR
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    config["max_position_embeddings"] = LONG_CONTEXT
    target.mkdir(parents=True, exist_ok=True)
    for path in DEFAULT_MODEL_DIR.iterdir():
        link = target / path.name
        if path.name != "config.json" and not link.exists():
            link.symlink_to(path.resolve())
    text = json.dumps(config, indent=2) + "\n"
    cfg = target / "config.json"
    if not cfg.is_file() or cfg.read_text() != text:
        cfg.write_text(text)
    return target


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def make_engine(model_dir: Path, **overrides):
    from worker.engine import Engine

    overrides.setdefault("num_threads", NUM_THREADS)
    overrides.setdefault("device", "cpu")
    return Engine.from_model_dir(str(model_dir), **overrides)


def greedy(max_tokens: int):
    from shared.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class StepCounter:
    """Wraps an engine's runner so each forward's sequences and tokens are counted, and timed.

    Counting at the runner's door measures what was really computed, including any recompute
    after a preemption, instead of trusting a formula."""

    def __init__(self, engine):
        self.engine = engine
        self.num_tokens = 0
        self.num_forwards = 0
        self.forward_s: list[float] = []
        self._inner = engine.runner.execute_splitting
        self._shadowed = "execute_splitting" in vars(engine.runner)
        engine.runner.execute_splitting = self._execute  # instance attribute: the class is untouched

    def _execute(self, seqs):
        self.num_tokens += sum(len(s.new_token_ids) for s in seqs)
        self.num_forwards += 1
        t0 = time.perf_counter()
        try:
            return self._inner(seqs)
        finally:
            self.forward_s.append(time.perf_counter() - t0)

    def reset(self) -> None:
        self.num_tokens = self.num_forwards = 0
        self.forward_s = []

    def detach(self) -> None:
        if self._shadowed:
            self.engine.runner.execute_splitting = self._inner
        else:
            del self.engine.runner.execute_splitting


def run_to_completion(engine, timeout_s: float = 600.0) -> dict[str, object]:
    """Step until nothing is left; returns each request's final RequestOutput by id."""
    final = {}
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine did not finish within {timeout_s:.0f} s")
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.final
    return final


def warm_up(engine, vocab: int, prompt_len: int = 64, max_tokens: int = 8) -> None:
    """One short request first, so lazy initialisation and allocator growth are not timed."""
    engine.add_request("warmup", list(range(FIRST_ORDINARY_ID, FIRST_ORDINARY_ID + prompt_len)),
                       greedy(max_tokens))
    run_to_completion(engine)


def percentile(values: list[float], q: float) -> float:
    from bench.load_stats import percentile as pct

    out = pct(list(values), q)
    return float("nan") if out is None else out
