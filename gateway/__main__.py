"""`python -m gateway [--supervise] [--config FILE] [overrides]`: run the gateway until SIGTERM
(exit 0 after draining).

With `--supervise` (the Procfile's entry) this process is only a supervisor
(shared/supervisor.py): it runs `python -m gateway` without the flag as its child and restarts
it whenever it exits, so a gateway crash, kill -9 or SIGTERM to the gateway alone never ends
`honcho start` and with it the workers; they reconnect to the restarted gateway by themselves.
SIGTERM/SIGINT to the supervisor drain the gateway, then both exit 0.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from gateway.listen import ListenError, check_can_listen
from gateway.open_files import fit_open_files
from shared.config import ClusterConfig, ConfigError, add_config_flags, config_from_args
from shared.cpu_affinity import GATEWAY, pin_process
from shared.ipc import EndpointInUseError, check_no_listener, remove_stale_ipc_socket
from shared.supervisor import EXIT_DO_NOT_RESTART, supervise

SUPERVISE_FLAG = "--supervise"
# Past the drain grace: the gateway's own gRPC stop (1 s) and dispatcher shutdown.
STOP_SLACK_S = 5.0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    parser.add_argument(SUPERVISE_FLAG, action="store_true",
                        help="run as a supervisor that restarts the gateway process whenever it exits")
    add_config_flags(parser)
    args = parser.parse_args(argv)
    from gateway.auth import KeyStore, check_exposure
    from shared.curve import GATEWAY as GATEWAY_ROLE, transport_keys
    try:
        config = config_from_args(args)
        # Checked before any supervisor loop, so an exposed start fails once, with the reason.
        check_exposure(config.gateway, KeyStore.from_config(config.gateway))
        transport_keys(config, GATEWAY_ROLE)
    except ConfigError as e:  # argparse's error line without its usage, which lists every config flag
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    if args.supervise:
        return run_supervisor(config, [a for a in argv if a != SUPERVISE_FLAG])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(message)s")
    log = logging.getLogger("gateway")
    try:
        if remove_stale_ipc_socket(config.worker_endpoint):
            log.info("removed the stale socket a gateway that did not close left at %s", config.worker_endpoint)
    except (EndpointInUseError, ValueError) as e:
        log.error("%s", e)
        return 2
    if cores := pin_process(GATEWAY, config):
        log.info("pinned to cores %s (worker.reserved_cores)", cores)
    fit_open_files(config.gateway.max_connections, 2 if config.gateway.http_port else 1)
    from gateway.server import Gateway
    from gateway.tokenizer import TokenizerError

    async def run() -> int:
        try:
            return await Gateway(config).serve()
        except ListenError as e:  # raised only while binding, before anything is served
            log.error("%s", e)
            return 2
        except TokenizerError as e:  # raised while starting: every start would fail the same way, no restart
            log.error("%s", e)
            return EXIT_DO_NOT_RESTART

    return asyncio.run(run())


def run_supervisor(config: ClusterConfig, child_args: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s supervisor gateway %(levelname)s %(message)s")
    endpoint = config.worker_endpoint
    # A second cluster started on the same run_dir, or a gateway on a port that is taken, stops
    # here, once, instead of its gateway failing the same check in a restart loop.
    g = config.gateway
    try:
        check_no_listener(endpoint)
        check_can_listen(g.host, g.port, g.reuse_port, "gRPC", "gateway.port")
        if g.http_port:
            check_can_listen(g.host, g.http_port, g.reuse_port, "HTTP", "gateway.http_port")
    except (EndpointInUseError, ListenError) as e:
        logging.getLogger("supervisor").error("%s", e)
        return 2
    max_backoff_s = max(config.gateway.restart_backoff_s, config.worker.max_restart_backoff_s)
    return supervise("gateway", [sys.executable, "-m", "gateway", *child_args], config.gateway.restart_backoff_s,
                     max_backoff_s, stop_timeout_s=config.gateway.drain_grace_s + STOP_SLACK_S)


if __name__ == "__main__":
    sys.exit(main())
