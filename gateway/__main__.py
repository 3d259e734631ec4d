"""`python -m gateway [--config FILE] [overrides]`: run the gateway until SIGTERM (exit 0 after draining)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from shared.config import ConfigError, add_config_flags, config_from_args
from shared.cpu_affinity import GATEWAY, pin_process


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    add_config_flags(parser)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(message)s")
    if cores := pin_process(GATEWAY, config):
        logging.getLogger("gateway").info("pinned to cores %s (worker.reserved_cores)", cores)
    from gateway.server import Gateway

    async def run() -> int:
        return await Gateway(config).serve()

    return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
