"""``python -m sglang_eaas.tools.scale URL show | URL to N``: the expert tier's admin API.

    python -m sglang_eaas.tools.scale http://127.0.0.1:30000 show
    python -m sglang_eaas.tools.scale http://127.0.0.1:30000 to 4 [--id ID] [--no-wait]

``to`` asks SGLang (started with ``--eaas``) to resize its expert tier to N active servers and,
unless ``--no-wait``, prints the operation's progress until it is done. Repeating a command
with the same ``--id`` does not start a second resize. Exit status: 0 done, 1 failed or
refused, 2 bad arguments (docs/elastic.md, "Admin API").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
import uuid

from sglang_eaas import envs
from sglang_eaas.elastic.operations import TOKEN_HEADER


class AdminError(RuntimeError):
    pass


def request(url: str, token: str, api_key: str, body: dict | None = None,
            timeout: float = 30.0) -> tuple[int, dict]:
    """``(status, JSON reply)`` of one admin API call."""
    headers = {TOKEN_HEADER: token, "Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers,
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except ValueError:
            return exc.code, {"error": exc.reason}
    except (urllib.error.URLError, OSError) as exc:
        raise AdminError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_eaas.tools.scale",
                                description="Show or resize an SGLang --eaas server's expert "
                                "tier through its admin API.")
    p.add_argument("url", help="SGLang's HTTP address, e.g. http://127.0.0.1:30000")
    p.add_argument("action", choices=["show", "to"],
                   help="'show': the active and standby servers and the last operation; "
                   "'to N': resize to N active expert servers")
    p.add_argument("servers", nargs="?", type=int, help="with 'to': active servers wanted")
    p.add_argument("--id", default="",
                   help="operation id: asking again with the same id returns that operation "
                   "instead of starting another (default: a fresh one)")
    p.add_argument("--no-wait", action="store_true",
                   help="with 'to': return once the operation has started")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="with 'to': seconds to wait for the operation; default %(default)s")
    p.add_argument("--token", default=None,
                   help="the tier's shared token (default: SGLANG_EAAS_TOKEN)")
    p.add_argument("--api-key", default="",
                   help="SGLang's --api-key, if the server was started with one")
    args = p.parse_args(argv)
    if args.action == "to" and (args.servers is None or args.servers < 1):
        p.error("'to' needs the number of active servers wanted, >= 1")
    if args.action == "show" and args.servers is not None:
        p.error("'show' takes no number")
    args.token = envs.TOKEN.get() if args.token is None else args.token
    if not args.token:
        p.error(f"the admin API needs the tier's token: pass --token or set {envs.TOKEN.name}")
    args.url = args.url.rstrip("/")
    return args


def show(tier: dict) -> str:
    lines = [f"active expert servers: {len(tier['active'])}; standby: {len(tier['standby'])}"
             f"; launcher: {tier['launcher']}"]
    for server in tier["active"]:
        per_layer = tier["experts"].get(server, {})
        counts = sorted({len(ids) for ids in per_layer.values()})
        lines.append(f"  {server}: {'/'.join(map(str, counts))} experts per MoE layer")
    for server in tier["standby"]:
        lines.append(f"  {server}: standby")
    op = tier.get("operation")
    if op:
        lines.append(f"operation {op['id']} (to {op['servers']}): {op['state']}"
                     + (f": {op['result']}" if op["result"] else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.action == "show":
            status, reply = request(f"{args.url}/eaas/tier", args.token, args.api_key)
            if status != 200:
                raise AdminError(reply.get("error", f"HTTP {status}"))
            print(show(reply))
            return 0
        op_id = args.id or uuid.uuid4().hex[:12]
        status, reply = request(f"{args.url}/eaas/scale", args.token, args.api_key,
                                {"servers": args.servers, "id": op_id})
        if status not in (200, 202):
            raise AdminError(reply.get("error", f"HTTP {status}"))
        print(f"operation {op_id}: resize to {args.servers} active expert servers "
              f"({'started' if status == 202 else 'already asked for'})", flush=True)
        deadline = time.monotonic() + args.timeout
        while reply["state"] == "running" and not args.no_wait:
            if time.monotonic() > deadline:
                raise AdminError(f"operation {op_id} still running after {args.timeout:.0f}s")
            time.sleep(0.5)
            status, reply = request(f"{args.url}/eaas/operations/{op_id}", args.token,
                                    args.api_key)
            if status != 200:
                raise AdminError(reply.get("error", f"HTTP {status}"))
        print(f"operation {op_id}: {reply['state']}" + (f": {reply['result']}"
                                                         if reply["result"] else ""))
        return 1 if reply["state"] == "failed" else 0
    except AdminError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
