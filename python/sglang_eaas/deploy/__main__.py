"""``python -m sglang_eaas.deploy CONFIG.yaml``: start a whole local deployment, serve until Ctrl-C
or SIGTERM, then stop every process it started, in order."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import tempfile
from pathlib import Path

from sglang_eaas import envs
from sglang_eaas.deploy import parts, ports
from sglang_eaas.deploy.config import FORMAT, DeployConfig, DeployConfigError, load_config
from sglang_eaas.deploy.deployment import DeployError, Deployment, Interrupted, format_table

DESCRIPTION = """\
Start a whole local deployment from one YAML config: a monitor (standalone or etcd) and N expert
servers (unless sglang.eaas is false), SGLang instances (plain, or prefill and decode), and the
router in front of them. Each part is started once the parts before it serve; then a table says
where each part listens, its pid and its log file, and a line 'deploy: serving at URL' says where
to send requests (/generate, /v1/completions, ... of the router). Ctrl-C or SIGTERM stops every
process it started (router, SGLang instances, expert servers, monitor, in this order: SIGTERM,
SIGKILL after --stop-grace seconds; a second Ctrl-C kills at once), removes the /dev/shm files
their processes left (SGLang's load snapshots and semaphores) and exits 0. An expert server
that dies while serving is started again (up to 3 times; the other holders of its experts serve
them meanwhile); any other part that dies stops everything, with exit status 1. The token the
parts share is SGLANG_EAAS_TOKEN if set, else a new one; it is passed in the environment, never
on a command line.
"""

EPILOG = "config format (every field but model is optional):\n\n" + FORMAT + """
Ports are free ones picked at start, except router.port, a placement file's HOST:PORT keys and
--NAME-port flags in args: those are checked free before anything starts. Relative paths are
read from the current directory.
Example: python -m sglang_eaas.deploy examples/deploy/local-pd.yaml"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_eaas.deploy", description=DESCRIPTION,
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", metavar="CONFIG.yaml", help="the deployment's config (format below)")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="folder of the parts' log files (one per part, NAME.log); default "
                   ".cache/logs/deploy/CONFIG-DATE-TIME")
    p.add_argument("--check", action="store_true",
                   help="check the config and print the command of every part, start nothing")
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="longest wait for each stage to serve (monitor, expert servers, SGLang "
                   "instances, router); default %(default)s")
    p.add_argument("--stop-grace", type=float, default=30.0, metavar="SECONDS",
                   help="how long each stage may take to exit after SIGTERM before it is "
                   "SIGKILLed; default %(default)s")
    args = p.parse_args(argv)
    if not args.timeout > 0:
        p.error("--timeout must be > 0")
    if not args.stop_grace >= 0:
        p.error("--stop-grace must be >= 0")
    try:
        config = load_config(args.config)
    except DeployConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(plan(config))
        return 0
    return serve(Deployment(config, args.log_dir, progress=_say, timeout=args.timeout,
                            stop_grace=args.stop_grace, failure=_error))


def serve(deployment: Deployment) -> int:
    def on_signal(signum, _frame):
        if deployment.interrupted:
            deployment.hurry()
        else:
            _say(f"deploy: {signal.Signals(signum).name}: stopping")
            deployment.interrupt()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        deployment.start()
    except Interrupted:
        return _stopped(deployment, 1, "deploy: interrupted before serving")
    except DeployError:  # said by _error before the parts started were stopped
        return _stopped(deployment, 1, "deploy: did not start")
    _say(format_table(deployment.endpoints()))
    _say(f"deploy: serving at {deployment.url} (Ctrl-C or SIGTERM stops everything)")
    while not deployment.wait_interrupt(1.0):
        for line in deployment.restart_lost_servers():
            _say(line)
        child = deployment.dead(serving=True)
        if child is not None:
            _error(f"{child.name} (pid {child.pid}) exited with code {child.exit_code()} "
                   f"while serving; see {child.log_path}; stopping everything")
            return _stopped(deployment, 1, "deploy: stopped after a part died")
    return _stopped(deployment, 0, "deploy: stopped, no process or shared-memory file left")


def _stopped(deployment: Deployment, code: int, line: str) -> int:
    notes = deployment.stop()  # after a failed start: what that stop said
    for note in notes:
        print(f"deploy: {note}", file=sys.stderr, flush=True)
    _say(line if not notes else "deploy: stopped")
    return code if not any("still there after SIGKILL" in n for n in notes) else 1


def plan(config: DeployConfig) -> str:
    """What ``--check`` prints: the config's parts and their commands (ports picked now)."""
    picked = parts.Ports({p.port for p in ports.fixed_ports(config)})
    logs = Path("LOG_DIR")
    lines = [f"{config.source}: valid. The parts, in start order (ports are picked again at "
             f"start; the token goes in {envs.TOKEN.name}, never on a command line):"]
    monitor_url = None
    if config.sglang.eaas:
        etcd_dir = Path(tempfile.gettempdir()) / "eaas-deploy-etcd-XXXX"
        monitor, monitor_url = parts.monitor_child(config, picked, logs, etcd_dir)
        lines.append(_line(monitor) if monitor else f"  monitor: an existing one, {monitor_url}")
        dtype = config.sglang.dtype if config.sglang.dtype not in (None, "auto") else (
            "<the dtype SGLang resolves for --dtype auto>")
        lines += [_line(c) for c in parts.expert_server_children(config, monitor_url, picked,
                                                                  logs, dtype)]
    sglang = parts.sglang_parts(config, monitor_url, picked, logs)
    lines += [_line(p.child) for p in sglang]
    router, url = parts.router_child(config, sglang, picked, logs)
    lines += [_line(router), f"requests go to {url}"]
    return "\n".join(lines)


def _line(child) -> str:
    command = ["python" if a == sys.executable else a for a in child.command]
    return f"  {child.name}: {shlex.join(command)}"


def _error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def _say(line: str) -> None:
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
