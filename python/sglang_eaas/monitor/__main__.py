"""``python -m sglang_eaas.monitor --listen HOST:PORT``: a standalone monitor, for deployments
where several SGLang instances share one pool of expert servers."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from sglang_eaas import envs
from sglang_eaas.addresses import AddressError, parse_address
from sglang_eaas.membership import LOSS_TIMEOUT, SUSPECT_TIMEOUT, suspect_timeout
from sglang_eaas.protocol.operations import LEASE_TTL


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sglang_eaas.monitor",
        description="The sglang-eaas monitor: expert servers and attention clients register "
        "and heartbeat here; clients learn of joins, drains and losses from it. SGLang starts "
        "one itself (--eaas-monitor embedded); run this one when several SGLang instances share "
        "one pool of expert servers (--eaas-monitor HOST:PORT, expert servers --monitor "
        "HOST:PORT).")
    p.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="where members connect (port 0: a free one, printed); default "
                   "%(default)s")
    p.add_argument("--token", default=None,
                   help="shared secret every member must present (default: the "
                   f"{envs.TOKEN.name} environment variable); required")
    p.add_argument("--suspect-timeout", type=float, default=None, metavar="SECONDS",
                   help="a member that has not heartbeated for this long is suspected: "
                   "clients send its experts' tokens to their other holders, nothing else "
                   "changes, and its next heartbeat clears it (a member's heartbeat period must "
                   f"be at most half of it); default {SUSPECT_TIMEOUT}, or the loss timeout "
                   "if that is shorter")
    p.add_argument("--loss-timeout", type=float, default=LOSS_TIMEOUT, metavar="SECONDS",
                   help="a member that has not heartbeated for this long is lost (it must "
                   "register again to be used); a dead process is lost at once (its connection "
                   "closes) and a hung server when a client's result timeout reports it, so "
                   "this only bounds what nothing else sees; default %(default)s")
    p.add_argument("--no-verify-servers", action="store_true",
                   help="accept a server's registration without asking the server at its "
                   "address whether it holds what it registers (not recommended)")
    p.add_argument("--operation-grace", type=float, default=LEASE_TTL, metavar="SECONDS",
                   help="after a restart, while the expert servers say an operation lease was "
                   "granted before it started, new operation leases are refused this long so "
                   "that the lease's holder can reclaim it (the tier controller, docs/elastic."
                   "md); default %(default)s")
    p.add_argument("--log-level", default="info", help="logging level; default %(default)s")
    args = p.parse_args(argv)
    try:
        host, port = parse_address(args.listen, allow_port_zero=True)
    except AddressError as exc:
        p.error(f"--listen: {exc}")
    token = envs.TOKEN.get() if args.token is None else args.token
    if not token:
        p.error(f"the monitor needs a shared token: pass --token or set {envs.TOKEN.name}")
    if not args.loss_timeout > 0:
        p.error("--loss-timeout must be > 0")
    suspect = suspect_timeout(args.loss_timeout, args.suspect_timeout)
    if not 0 < suspect <= args.loss_timeout:
        p.error(f"--suspect-timeout must be > 0 and at most the loss timeout "
                f"({args.loss_timeout}s), got {suspect}")
    if not 0 <= args.operation_grace <= 600:
        p.error(f"--operation-grace must be 0-600 seconds, got {args.operation_grace}")
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s monitor] %(message)s")
    from sglang_eaas.monitor.server import MonitorConfig, MonitorServer

    monitor = MonitorServer(MonitorConfig(host, port, token, args.loss_timeout, suspect,
                                          not args.no_verify_servers,
                                          args.operation_grace)).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"sglang-eaas monitor ready on {monitor.address} (suspect timeout {suspect}s, loss "
          f"timeout {args.loss_timeout}s)", flush=True)
    stop.wait()
    monitor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
