"""`python -m tools.curve_keys DIR [--force]`: write a gateway and a worker CURVE key pair into DIR.

The files are zmq.auth's certificates: DIR/gateway.key, DIR/gateway.key_secret, DIR/worker.key and
DIR/worker.key_secret (secret files 0600, DIR 0700 when it is made). The gateway's dir needs its
own pair and the public key of every worker it admits (`*.key`); a worker's dir needs gateway.key
and its own pair (docs/security.md). Existing key files are never replaced without --force.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shared.curve import write_keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.curve_keys", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", type=Path, help="folder for the four key files")
    parser.add_argument("--force", action="store_true", help="replace key files that already exist")
    args = parser.parse_args(argv)
    try:
        written = write_keys(args.dir, force=args.force)
    except FileExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
