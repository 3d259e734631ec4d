"""llama.cpp's llama-server as a benchmark baseline: find the binaries, convert bench-small to GGUF once,
and run the server as a process that is always torn down.
(`convert_to_gguf` converts any random checkpoint the same way.)

The binaries and sources come from `shared/tools/build-llama-cpp` (cached under
`~/.cache/llama.cpp-<version>/`; `$LLAMA_CPP_DIR` points at another such folder). bench-small
(bench/checkpoints.py) has no tokenizer of its own, and llama.cpp's converter needs one: a small
SentencePiece model is trained on Python's own documentation text (`pydoc_data.topics`, 16,000
pieces, all it can support) and placed beside the weights, and the ids above it become plain
user-defined tokens (`[t16000]`..., via added_tokens.json), so every id the random model samples
detokenizes to text, as on our side. Prompts are sent as token ids, so which tokenizer it is changes
nothing but the text streamed back. The float32 GGUF lands in `.cache/bench-small-gguf/`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.checkpoints import DEFAULT_DIR as BENCH_SMALL_DIR, REPO_ROOT, ensure_bench_small
from bench.cluster_process import free_port

GGUF_DIR = REPO_ROOT / ".cache" / "bench-small-gguf"
GGUF_NAME = "bench-small-f32.gguf"
SP_VOCAB = 16_000  # the most pieces SentencePiece builds from pydoc_data.topics
READY_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0


def find_llama_cpp() -> tuple[Path | None, str]:
    """(folder with bin/ and src/, "") or (None, why not)."""
    candidates = []
    if os.environ.get("LLAMA_CPP_DIR"):
        candidates.append(Path(os.environ["LLAMA_CPP_DIR"]))
    candidates += sorted(Path.home().glob(".cache/llama.cpp-*"), reverse=True)
    for folder in candidates:
        if (folder / "bin" / "llama-server").is_file():
            return folder, ""
    return None, ("no llama-server under $LLAMA_CPP_DIR or ~/.cache/llama.cpp-*/bin "
                  "(shared/tools/build-llama-cpp builds it)")


def _train_tokenizer(target: Path) -> None:
    import sentencepiece as spm  # an ImportError tells the caller what is missing
    from pydoc_data.topics import topics

    lines = [line for text in topics.values() for line in text.splitlines() if line.strip()]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(target / "sp"),
                                   vocab_size=SP_VOCAB, model_type="bpe", character_coverage=1.0,
                                   byte_fallback=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    (target / "sp.model").rename(target / "tokenizer.model")
    (target / "sp.vocab").unlink(missing_ok=True)


def bench_small_gguf(llama_dir: Path) -> Path:
    """The float32 GGUF of bench-small, converted once (a few seconds) with llama.cpp's own converter."""
    return convert_to_gguf(llama_dir, ensure_bench_small(BENCH_SMALL_DIR), GGUF_DIR / GGUF_NAME)


def convert_to_gguf(llama_dir: Path, source: Path, out: Path) -> Path:
    """`out`, the float32 GGUF of the random checkpoint `source` (no tokenizer of its own: one is
    trained for the converter, see the module's docstring), converted once."""
    if out.is_file():
        return out
    hf = out.parent / f"{out.stem}-hf"
    shutil.rmtree(hf, ignore_errors=True)
    hf.mkdir(parents=True)
    for path in source.iterdir():
        (hf / path.name).symlink_to(path.resolve())
    _train_tokenizer(hf)
    vocab_size = json.loads((source / "config.json").read_text())["vocab_size"]
    (hf / "added_tokens.json").write_text(json.dumps({f"[t{i}]": i for i in range(SP_VOCAB, vocab_size)}))
    src = llama_dir / "src"
    partial = out.with_suffix(".partial")
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    proc = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f32",
                           "--outfile", str(partial)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    partial.rename(out)
    shutil.rmtree(hf, ignore_errors=True)
    return out


class LlamaServer:
    """`with LlamaServer(bin_dir, gguf, threads=2, parallel=16, ctx=16384) as s:` then load s.base_url."""

    def __init__(self, llama_dir: Path, model: Path, threads: int, parallel: int, ctx: int, alias: str = "bench-small"):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.alias = alias
        self.args = [str(llama_dir / "bin" / "llama-server"), "-m", str(model), "-t", str(threads),
                     "-np", str(parallel), "-cb", "-c", str(ctx), "--host", "127.0.0.1", "--port", str(self.port),
                     "--alias", alias]
        self.log_path = GGUF_DIR / f"llama-server-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "LlamaServer":
        env = {**os.environ, "LD_LIBRARY_PATH": str(Path(self.args[0]).parent)}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=env)
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited {self.proc.returncode}:\n{self.logs()}")
                try:
                    with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                        if r.status == 200:
                            return self
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
                time.sleep(0.2)
            raise TimeoutError(f"llama-server not ready within {READY_TIMEOUT_S:.0f} s:\n{self.logs()}")
        except BaseException:
            self.stop()
            raise

    def cpu_seconds(self) -> dict[str, float]:
        import psutil
        try:
            t = psutil.Process(self.proc.pid).cpu_times()
            return {"llama-server": t.user + t.system}
        except (psutil.Error, AttributeError):
            return {"llama-server": 0.0}

    def logs(self, tail_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail_chars:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                pass
        self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
