"""llama.cpp's own benchmark tools as a baseline: a checkpoint's GGUF in f32, bf16, f16, q8_0 and q4_0, the
single-stream decode rate by `llama-bench` (tg) and the batched generation rate by
`llama-batched-bench`. The binaries come from `shared/tools/build-llama-cpp` (bench/llama_server.py
finds them); conversions are cached beside the checkpoint's other GGUFs in `.cache/`."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from bench.checkpoints import REPO_ROOT
from bench.llama_server import convert_to_gguf

GGUF_TYPES = ("f32", "bf16", "f16", "q8_0", "q4_0")
TIMEOUT_S = 3600


def gguf_files(llama_dir: Path, source: Path, name: str) -> dict[str, Path]:
    """{type: GGUF} for every GGUF_TYPES entry, made once: the f32 conversion, then llama-quantize."""
    folder = REPO_ROOT / ".cache" / f"{name}-gguf"
    f32 = convert_to_gguf(llama_dir, source, folder / f"{name}-f32.gguf")
    files = {"f32": f32}
    for kind in GGUF_TYPES[1:]:
        out = folder / f"{name}-{kind}.gguf"
        if not out.is_file():
            partial = out.with_suffix(".partial")
            _run([str(llama_dir / "bin" / "llama-quantize"), str(f32), str(partial), kind.upper()])
            partial.rename(out)
        files[kind] = out
    return files


def _run(argv: list[str]) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(argv[0]).name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def decode_rate(llama_dir: Path, gguf: Path, threads: int, new_tokens: int, repeats: int) -> float:
    """llama-bench's tg<new_tokens>: generated tokens/s of one stream from an empty context."""
    out = _run([str(llama_dir / "bin" / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", "0",
                "-n", str(new_tokens), "-r", str(repeats), "-o", "json"])
    rows = [r for r in json.loads(out) if r.get("n_gen") == new_tokens and not r.get("n_prompt")]
    if not rows:
        raise RuntimeError(f"llama-bench printed no tg{new_tokens} row:\n{out[-2000:]}")
    return float(rows[0]["avg_ts"])


_BATCHED_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|(.*)\|\s*$")


def batched_rate(llama_dir: Path, gguf: Path, threads: int, prompt_len: int, new_tokens: int,
                 sequences: int) -> float:
    """llama-batched-bench: `sequences` streams of `prompt_len` + `new_tokens`; generated tokens over
    the whole run's time (npl x ntg / T), the figure that compares with output tokens/s. Without
    weight repacking: this build's repacked q8_0 / q4_0 kernels crash (SIGSEGV, SIGILL) on steps
    of more than one token on this CPU, while its single-token steps (llama-bench tg) run them."""
    context = sequences * (prompt_len + new_tokens) + 16
    out = _run([str(llama_dir / "bin" / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads), "-c",
                str(context), "-b", "2048", "-ub", "512", "-npp", str(prompt_len), "-ntg", str(new_tokens),
                "-npl", str(sequences), "--no-repack"])
    for line in out.splitlines():
        match = _BATCHED_ROW.match(line.strip())
        if match and (int(match[1]), int(match[2]), int(match[3])) == (prompt_len, new_tokens, sequences):
            # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
            total_s = float(match[5].split("|")[4])
            return sequences * new_tokens / total_s
    raise RuntimeError(f"llama-batched-bench printed no row for {prompt_len}/{new_tokens}/{sequences}:\n{out[-2000:]}")
