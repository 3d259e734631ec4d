"""Regenerate protos/*_pb2*.py from protos/*.proto with grpcio-tools.

Run from anywhere: `python -m tools.gen_protos [--out DIR]`. The generated modules are
committed; tests/test_protos.py regenerates them into a temporary folder and compares.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_PROTOS = ("protos/inference.proto",)  # services: gets *_pb2_grpc.py too
WIRE_PROTOS = ("protos/worker.proto",)  # messages only; the worker never imports grpc


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc
    import grpc_tools

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    # Paths are relative to the repository root so generated imports read `from protos import ...`.
    common = ["grpc_tools.protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}"]
    for args in ([*common, f"--grpc_python_out={out_dir}", *PUBLIC_PROTOS], [*common, *WIRE_PROTOS]):
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted((out_dir / "protos").glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT, help="folder that receives protos/*_pb2*.py")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
