"""Quantize a float checkpoint once, offline, into a folder the worker serves directly.

    python -m tools.quantize_checkpoint models/default /tmp/default-int4 --quantization int4

Calibrates first (the model's own samples by default; reused from beside the source
checkpoint when it was done before), quantizes by the rule, and writes the quantized
checkpoint (worker/model/quantized_checkpoint.py). Serve it with `MODEL=/tmp/default-int4
honcho start`; the worker sees the quantization in its config.json. Input it cannot use (a missing
or malformed checkpoint, a setting out of range, an unreadable calibration file) exits 2 with one
line naming it, as argparse does.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from shared.engine_config import ConfigError
from worker.engine import Engine
from worker.model.config import CheckpointError, UnsupportedModelError
from worker.model.quantize_model import PRESETS
from worker.model.quantized_checkpoint import save_quantized_checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, help="the float checkpoint (a Hugging Face folder)")
    parser.add_argument("out_dir", type=Path, help="where to write the quantized checkpoint")
    parser.add_argument("--quantization", choices=sorted(set(PRESETS) - {"none"}), default="int8")
    parser.add_argument("--rule", default="", help="replaces the mixed preset's rule, e.g. 'params>=1e6:int8,*:int4'")
    parser.add_argument("--group-size", type=int, default=128, help="INT4 group size")
    parser.add_argument("--symmetric", action="store_true", help="INT4 without zero points")
    parser.add_argument("--calibration", default="self", help="'self', a text file, or 'none' (plain rounding)")
    args = parser.parse_args(argv)
    # Before the model loads and calibrates (minutes): what the arguments alone refuse.
    if args.out_dir.resolve() == args.model_dir.resolve():
        parser.error(f"out_dir {args.out_dir} is the source checkpoint: write the quantized one to another folder")
    if args.rule and args.quantization != "mixed":
        parser.error(f"--rule replaces the mixed preset's rule: use it with --quantization mixed "
                     f"(it is {args.quantization})")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        engine = Engine.from_model_dir(args.model_dir, device="cpu", num_kv_blocks=256, enable_prefix_caching=False,
                                       quantization=args.quantization, quantization_rule=args.rule,
                                       quantization_group_size=args.group_size,
                                       quantization_symmetric=args.symmetric,
                                       quantization_calibration=args.calibration)
    except (ConfigError, CheckpointError, UnsupportedModelError) as e:
        parser.error(str(e))
    report = engine.quantization_report
    rule = engine.config.quantization_rule_parsed()
    info = engine.calibration.info if engine.calibration is not None else None
    save_quantized_checkpoint(engine.model, report, args.model_dir, args.out_dir, rule.text, info)
    print(f"wrote {args.out_dir}: {report.num_quantized}, {report.float_bytes / 2**20:.2f} MiB of projections -> "
          f"{report.quantized_bytes / 2**20:.2f} MiB"
          + (f"; calibration: {engine.calibration.summary()}" if engine.calibration is not None else ""))


if __name__ == "__main__":
    main()
