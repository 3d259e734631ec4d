"""Where a benchmark writes its JSON: the path given, else its default, or `<stem>_quick.json`
beside the default for a --quick run (so a smoke run never overwrites a measurement)."""
from __future__ import annotations

import json
from pathlib import Path


def write_results(results: dict, given: str | Path | None, default: Path, quick: bool) -> Path:
    path = Path(given) if given else (default.with_name(f"{default.stem}_quick.json") if quick else default)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str))
    return path
