"""``python -m sglang_eaas.tools.scale URL show | to N | retire ADDRESS... | operations [ID]``:
the expert tier's admin API (docs/elastic.md, "Admin API").

    python -m sglang_eaas.tools.scale http://127.0.0.1:30000 show
    python -m sglang_eaas.tools.scale http://127.0.0.1:30000 to 4 [--id ID] [--wait S]
    python -m sglang_eaas.tools.scale http://127.0.0.1:30000 retire 10.0.0.7:7000 [--replace]
    python -m sglang_eaas.tools.scale http://127.0.0.1:30000 operations [ID]

``to`` asks SGLang (started with ``--eaas``) to resize its expert tier to N active servers;
``retire`` to take the named servers out of it (their experts move to the others first, then
they drain; with ``--servers N`` or ``--replace``, standby servers take their place up to N
active, or up to the active count). Both run
as an operation of the tier controller: one at a time in the tier, whoever asks. Unless
``--no-wait``, it prints the operation's progress until it ends, then reads the tier back.
Repeating a command with the same ``--id`` does not start a second operation. Refused before
anything starts, in one sentence: a URL that is not http(s)://HOST:PORT, a count beyond what
the placement can use or ``--eaas-max-servers``, a server not in the tier, and (unless
``--wait`` lets it wait) a request while another operation holds the tier. Exit status: 0 the
tier is as asked (read back), 1 failed, refused, rolled back or not as asked, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

from sglang_eaas import envs
from sglang_eaas.addresses import AddressError, parse_address
from sglang_eaas.protocol.operations import FINAL, TOKEN_HEADER
from sglang_eaas.tools import operation_flags

FIRST_CONTACT = 5.0  # seconds SGLang has to answer the first call


class AdminError(RuntimeError):
    pass


def request(url: str, token: str, api_key: str, body: dict | None = None,
            timeout: float = 30.0) -> tuple[int, dict]:
    """``(status, JSON reply)`` of one admin API call; ``AdminError`` in one sentence when
    nothing that speaks the admin API answers there."""
    headers = {TOKEN_HEADER: token, "Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers,
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as reply:
            return reply.status, _json(url, reply.read(), reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code, _json(url, exc.read(), exc.code)
    except (TimeoutError, socket.timeout):
        raise AdminError(f"{url} did not answer within {timeout:.0f}s: is it SGLang's HTTP "
                         "port (--port), started with --eaas?") from None
    except http.client.HTTPException as exc:  # something answered, not in HTTP
        raise AdminError(f"{url} does not answer in HTTP ({type(exc).__name__}): is it "
                         "SGLang's HTTP port (--port), started with --eaas?") from None
    except (urllib.error.URLError, OSError) as exc:
        why = getattr(exc, "reason", None) or exc
        if isinstance(why, (TimeoutError, socket.timeout)):
            raise AdminError(f"{url} did not answer within {timeout:.0f}s: is it SGLang's HTTP "
                             "port (--port), started with --eaas?") from None
        raise AdminError(f"cannot reach {url}: {why} (is it SGLang's HTTP port, started "
                         "with --eaas?)") from None


def _json(url: str, raw: bytes, status: int) -> dict:
    try:
        reply = json.loads(raw or b"{}")
    except ValueError:
        reply = None
    if not isinstance(reply, dict):
        if status == 404:
            return {"error": f"{url} is not an admin API route (HTTP 404): is SGLang started "
                             "with --eaas?"}
        return {"error": f"{url} answered HTTP {status} without JSON: is it SGLang's HTTP "
                         "port, started with --eaas?"}
    return reply


def checked_url(url: str) -> str:
    """``url`` without a trailing slash; ``ValueError`` (one sentence) unless it is
    http(s)://HOST:PORT."""
    try:
        parts = urllib.parse.urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"URL {url!r} is not http://HOST:PORT ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None \
            or parts.path.strip("/") or parts.query:
        raise ValueError(f"URL {url!r} is not http://HOST:PORT (SGLang's HTTP address, e.g. "
                         "http://127.0.0.1:30000)")
    return f"{parts.scheme}://{parts.netloc}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sglang_eaas.tools.scale",
        description="Show, resize or retire servers of an SGLang --eaas server's expert tier "
        "through its admin API; every change is one operation of the tier controller, refused "
        "(exit 1, one sentence) while another holds the tier unless --wait, and refused before "
        "anything starts when out of bounds (more servers than the placement can use or "
        "--eaas-max-servers, a server not in the tier). Exit 0 only when the tier, read back, "
        "is as asked.")
    p.add_argument("url", help="SGLang's HTTP address, http(s)://HOST:PORT, e.g. "
                   "http://127.0.0.1:30000")
    p.add_argument("action", choices=["show", "to", "retire", "operations"],
                   help="'show': the active and standby servers and the latest operation; "
                   "'to N': resize to N active expert servers; 'retire ADDRESS...': take those "
                   "servers out (experts moved to the others first, then drained); "
                   "'operations [ID]': the latest operations, or one")
    p.add_argument("args", nargs="*", metavar="ARG",
                   help="N for 'to', server addresses (HOST:PORT) for 'retire', an operation "
                   "id for 'operations'")
    p.add_argument("--servers", type=int, default=None,
                   help="with 'retire': active servers to end with (standby servers take the "
                   "retired ones' place up to it); default: the active count less the retired")
    p.add_argument("--replace", action="store_true",
                   help="with 'retire': keep the active count, standby servers taking the "
                   "retired ones' place as far as there are some (what a Kubernetes pod's "
                   "preStop hook asks: deploy/k8s/expert-pool.yaml)")
    operation_flags.add(p, "refused at once, naming it")
    p.add_argument("--no-wait", action="store_true",
                   help="return once the operation has started, without following it")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to follow the operation; default %(default)s")
    p.add_argument("--token", default=None,
                   help="the tier's shared token (default: SGLANG_EAAS_TOKEN)")
    p.add_argument("--api-key", default="",
                   help="SGLang's --api-key, if the server was started with one")
    args = p.parse_args(argv)
    try:
        args.url = checked_url(args.url)
    except ValueError as exc:
        p.error(str(exc))
    if args.action == "to":
        if len(args.args) != 1 or not args.args[0].isdigit() or int(args.args[0]) < 1:
            p.error("'to' takes one number: the active servers wanted, >= 1")
        args.count = int(args.args[0])
    elif args.action == "retire":
        if not args.args:
            p.error("'retire' takes the addresses (HOST:PORT) of the servers to retire")
        for address in args.args:
            try:
                parse_address(address)
            except AddressError as exc:
                p.error(f"'retire' {address!r}: {exc}")
    elif args.action == "operations" and len(args.args) > 1:
        p.error("'operations' takes at most one operation id")
    elif args.action == "show" and args.args:
        p.error("'show' takes no argument")
    if args.servers is not None and (args.action != "retire" or args.servers < 1):
        p.error("--servers goes with 'retire' and is >= 1")
    if args.replace and (args.action != "retire" or args.servers is not None):
        p.error("--replace goes with 'retire', without --servers")
    operation_flags.check(p, args)
    args.token = envs.TOKEN.get() if args.token is None else args.token
    if not args.token:
        p.error(f"the admin API needs the tier's token: pass --token or set {envs.TOKEN.name}")
    return args


def show(tier: dict) -> str:
    lines = [f"active expert servers: {len(tier['active'])}; standby: {len(tier['standby'])}"
             f"; launcher: {tier['launcher']}; at most {tier.get('max_servers', '-')} active"]
    for server in tier["active"]:
        per_layer = tier["experts"].get(server, {})
        counts = sorted({len(ids) for ids in per_layer.values()})
        lines.append(f"  {server}: {'/'.join(map(str, counts))} experts per MoE layer")
    for server in tier["standby"]:
        lines.append(f"  {server}: standby")
    op = tier.get("operation")
    if op:
        lines.append(operation_line(op))
    return "\n".join(lines)


def operation_line(op: dict) -> str:
    what = op.get("kind", "?")
    target = op.get("target", {})
    if what == "resize":
        what = f"resize to {target.get('servers')}"
    elif what == "retire":
        what = f"retire {', '.join(target.get('retire', ()))}"
    text = op.get("result") or op.get("progress") or ""
    return (f"operation {op['id']} ({what}, by {op.get('requester', '?')}): {op['state']}"
            + (f": {text}" if text else ""))


class Admin:
    def __init__(self, args: argparse.Namespace):
        self.args = args

    def get(self, path: str, timeout: float = 30.0) -> dict:
        status, reply = request(f"{self.args.url}{path}", self.args.token, self.args.api_key,
                                timeout=timeout)
        if status != 200:
            raise AdminError(reply.get("error", f"HTTP {status}"))
        return reply


def follow(admin: Admin, op_id: str, reply: dict, timeout: float) -> dict:
    """The operation once it ended, its progress printed meanwhile."""
    deadline, said = time.monotonic() + timeout, ""
    while reply["state"] not in FINAL:
        if reply.get("progress") and reply["progress"] != said:
            said = reply["progress"]
            print(f"  {said}", flush=True)
        if time.monotonic() > deadline:
            raise AdminError(f"operation {op_id} still {reply['state']} after {timeout:.0f}s")
        time.sleep(0.5)
        reply = admin.get(f"/eaas/operations/{op_id}")
    return reply


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    admin = Admin(args)
    try:
        if args.action == "show":
            print(show(admin.get("/eaas/tier", FIRST_CONTACT)))
            return 0
        if args.action == "operations":
            if args.args:
                print(operation_line(admin.get(f"/eaas/operations/{args.args[0]}",
                                               FIRST_CONTACT)))
            else:
                listed = admin.get("/eaas/operations", FIRST_CONTACT)
                print("\n".join(operation_line(op) for op in listed["operations"])
                      or "no operation yet")
            return 0
        admin.get("/eaas/tier", FIRST_CONTACT)  # SGLang with --eaas answers there, quickly
        op_id = args.id or f"op-{uuid.uuid4().hex[:12]}"
        body: dict = {"id": op_id, "wait": args.wait}
        if args.action == "to":
            body["servers"] = args.count
            asked = f"resize to {args.count} active expert servers"
        else:
            body["retire"] = list(args.args)
            if args.servers is not None:
                body["servers"] = args.servers
            if args.replace:
                body["replace"] = True
            asked = f"retire {', '.join(args.args)}"
        status, reply = request(f"{args.url}/eaas/scale", args.token, args.api_key, body,
                                timeout=30.0 + args.wait)
        if status not in (200, 202):
            raise AdminError(reply.get("error", f"HTTP {status}"))
        print(f"operation {op_id}: {asked} "
              f"({'started' if status == 202 else 'already asked for'})", flush=True)
        if args.no_wait:
            return 0
        reply = follow(admin, op_id, reply, args.timeout)
        print(operation_line(reply), flush=True)
        if reply["state"] != "done":
            return 1
        return reached(admin, args, reply)
    except AdminError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def reached(admin: Admin, args: argparse.Namespace, op: dict) -> int:
    """0 if the tier, read back, is what the operation asked for (1, saying how not)."""
    tier = admin.get("/eaas/tier")
    want = op["target"].get("servers")
    still = [s for s in op["target"].get("retire", ()) if s in tier["active"] + tier["standby"]]
    if len(tier["active"]) != want or still:
        print(f"error: the tier has {len(tier['active'])} active expert servers"
              + (f" and {still} still serving" if still else "")
              + f", not the {want} operation {op['id']} asked for (another operation may have "
              "changed it since)", file=sys.stderr)
        return 1
    print(f"tier: {len(tier['active'])} active expert servers, {len(tier['standby'])} standby",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
