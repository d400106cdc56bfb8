"""Run inside a network namespace by test_two_hosts: the expert host of a two-host deployment.
Starts etcd and two expert servers holding every expert, all listening on this host's network
address (the servers offer ``mooncake`` slots there), prints ``ready etcd://HOST:PORT ADDRESS
ADDRESS`` and serves until its stdin closes, then prints ``served N`` (the slot requests the
servers answered) and stops them.

    python netns_expert_host.py MODEL THIS_HOST_IP LOG_DIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from sglang_eaas.launcher.local_servers import start_local_servers
from sglang_eaas.protocol.control import probe
from sglang_eaas.tools.etcd_process import EtcdProcess

def main() -> int:
    model, host, logs = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    etcd = EtcdProcess(logs / "two-hosts-etcd.log", host=host).start()
    log = open(logs / "two-hosts-expert-servers.log", "w")
    try:
        servers = start_local_servers(
            model, [list(range(32))] * 2, "float32", max_clients=4, stdout=log, host=host,
            extra_args=("--monitor", etcd.url, "--transport", "mooncake"))
        print(f"ready {etcd.url} {' '.join(s.address for s in servers)}", flush=True)
        sys.stdin.read()  # until the test closes it
        token = os.environ["SGLANG_EAAS_TOKEN"]
        print(f"served {sum(probe(s.address, token).counter('requests') for s in servers)}",
              flush=True)
        for server in servers:
            server.stop()
    finally:
        etcd.stop()
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
