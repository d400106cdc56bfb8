"""``python -m sglang_eaas.deploy CONFIG.yaml``: a whole local deployment from one config.

Bad configs are refused with one sentence naming the field and start nothing; ``--check`` prints
every part's command (never the token); a part that cannot start stops the deployment with its
name and log, leaving no process; a child ignoring SIGTERM is killed after the grace period with
its own children.

One full PD deployment, started as the command a user types: a standalone monitor, two expert
servers each holding every expert, a prefill and a decode instance (``--disaggregation-mode``,
KV over SGLang's Mooncake backend on TCP), both ``--eaas`` clients of the pool, SGLang's router
in front. On the trained checkpoint (top-4, float32) greedy tokens through router -> prefill ->
decode equal monolithic SGLang's without PD; an expert server SIGKILLed while eight streams
decode loses no request and changes no token, and the deployment starts it again; after SIGTERM
it exits 0 with none of the processes it started left, and no file in /dev/shm. Where the host
allows a mount namespace (root), the command runs with a /dev/shm of its own
(``private_shm.py``), so what is left there is its own and other tests run meanwhile; elsewhere
the whole /dev/shm is compared with before it started (but files live processes use), with no
other test running (``alone``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import requests
import yaml
import private_shm
from conftest import ROOT, TRAINED, Hog
from streams import concurrent_streams

from sglang_eaas.deploy import DeployConfigError, load_config, parse_config
from sglang_eaas.addresses import accepts
from sglang_eaas.deploy.processes import Child, alive, stop_together
from sglang_eaas.membership import connect
from sglang_eaas.protocol.control import probe
from sglang_eaas.tools.server_process import CPU_ARGS

MODEL = TRAINED
PROMPTS = ("def fib(n):", "import json\n\n\ndef load(path):", "class Stack:\n    def push(self",
           "    while True:\n        line =")
NEW_TOKENS = 16
STREAMS = (*PROMPTS, "from collections import", "# Copyright", "def __repr__(self):",
           "    raise ValueError(")  # eight
STREAM_TOKENS = 40
SGLANG_ARGS = [*CPU_ARGS, "--dtype", "float32", "--eaas-poll-spin-us", "0"]


def deploy(*args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_eaas.deploy", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kwargs)


def config(**changes) -> dict:
    """A valid PD config of the trained model, with top-level sections replaced."""
    base = {"model": str(MODEL), "monitor": "standalone", "expert_servers": {"count": 2},
            "sglang": {"args": SGLANG_ARGS, "prefill": {"count": 1}, "decode": {"count": 1}},
            "router": {"port": 0}}
    return {**base, **changes}


# -- refusals: one sentence naming the field, nothing started ---------------------------------
def _without(key: str) -> dict:
    data = config()
    del data[key]
    return data


REFUSED = [
    (config(expert_servers={"count": 0}),
     "expert_servers.count: must be a positive integer, got 0"),
    (config(expert_servers={"count": 2, "replicas": 3}),
     "expert_servers.replicas: 3 copies of each expert need at least 3 servers, count is 2"),
    (config(expert_servers={"count": 40}), "expert_servers.count: 40 servers for 32 experts"),
    (config(expert_servers={"count": 2, "standby": -1}),
     "expert_servers.standby: must be a whole number of standby servers, 0-64, got -1"),
    (config(monitor="127.0.0.1:7100", monitor_args=["--loss-timeout", "2"]),
     "monitor_args: only a standalone monitor (monitor: standalone) is started"),
    (config(monitor_args=["--listen", "127.0.0.1:1"]),
     "monitor_args: --listen is set by the deployment itself; remove it"),
    (config(expert_servers={"count": 2, "placement": "p.yaml"}),
     "expert_servers: give one of count, placement and experts, not count and placement"),
    (config(expert_servers={"experts": ["0-15", "16-30"]}),
     "expert_servers.experts: MoE layer 0: experts [31] are on no expert server"),
    (config(expert_servers={"experts": ["0-15", "16-32"]}),
     "expert_servers.experts[1]: expert 32 does not exist: the model has 32"),
    (config(expert_servers={"count": 2, "args": "--kernel fast"}),
     "expert_servers.args: must be a list of command-line arguments (strings)"),
    (config(expert_servers={"count": 2, "args": ["--listen", "127.0.0.1:1"]}),
     "expert_servers.args: --listen is set by the deployment itself"),
    (config(expert_servers={"placement": "/nonexistent/p.yaml"}),
     "expert_servers.placement: /nonexistent/p.yaml: cannot read it"),
    (config(routers={"port": 1}), "routers: unknown field"),
    (config(sglang={"prefil": {"count": 1}}), "sglang.prefil: unknown field"),
    (config(sglang={"prefill": {"count": 1}}),
     "sglang.decode: a PD deployment needs decode instances too"),
    (config(sglang={"plain": {"count": 1}, "prefill": {}, "decode": {}}),
     "sglang.plain: give plain instances or prefill and decode instances, not both"),
    (config(sglang={"args": ["--port", "8000"]}),
     "sglang.args: --port is set by the deployment itself; remove it"),
    (config(sglang={"decode": {"args": ["--eaas-monitor=1.2.3.4:5"]}, "prefill": {}}),
     "sglang.decode.args: --eaas-monitor is set by the deployment itself; use monitor"),
    (config(sglang={"eaas": "yes"}), "sglang.eaas: must be true or false, got 'yes'"),
    (config(sglang={"args": ["--dtype", "float32"], "prefill": {"args": ["--dtype", "half"]},
                    "decode": {}}),
     "sglang: the instances are given different --dtype values (float32, half)"),
    (config(sglang={"plain": {}, "transfer_backend": "mooncake"}),
     "sglang.transfer_backend: only PD instances (prefill and decode) transfer KV"),
    (config(sglang={"eaas": False, "plain": {}}),
     "monitor: sglang.eaas is false, so no monitor is used"),
    (config(monitor="zk://h:1"), "monitor: 'zk://h:1': the only monitor URL scheme is etcd://"),
    (config(router={"port": 70000}), "router.port: must be a port number in 1-65535"),
    (config(router={"args": ["--worker-urls", "http://x:1"]}),
     "router.args: --worker-urls is set by the deployment itself; remove it"),
    (config(model="/nonexistent/model"),
     "model: /nonexistent/model is not a checkpoint folder (it has no config.json)"),
    (_without("model"), "model: required field is missing"),
    ([1, 2], "<config>: must be a mapping with at least 'model', got a list"),
]


@pytest.mark.parametrize("data,sentence", REFUSED, ids=[s.split(":")[0] for _, s in REFUSED])
def test_a_bad_config_is_one_sentence_naming_the_field(data, sentence):
    with pytest.raises(DeployConfigError) as refused:
        parse_config(data)
    message = str(refused.value)
    assert message.startswith(sentence), message
    assert "\n" not in message


def test_the_command_refuses_a_bad_config_in_one_line_and_starts_nothing(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config(expert_servers={"count": 0})))
    logs = tmp_path / "logs"
    result = deploy(str(path), "--log-dir", str(logs))
    assert result.returncode == 2, result.stderr
    assert result.stderr == "error: expert_servers.count: must be a positive integer, got 0\n"
    assert result.stdout == "" and not logs.exists()
    path.write_text("model: [unclosed\n")
    result = deploy(str(path))
    assert result.returncode == 2
    assert re.fullmatch(r"error: \S+bad.yaml: not valid YAML at line 2, column 1 \(.*\)\n",
                        result.stderr), result.stderr


def test_the_example_configs_are_valid():
    for name in ("local-pd.yaml", "local-plain.yaml"):
        cfg = load_config(ROOT / "examples" / "deploy" / name)
        assert cfg.sglang.eaas and len(cfg.expert_servers) == 2


def test_replicas_put_every_expert_on_that_many_servers():
    cfg = parse_config(config(expert_servers={"count": 3, "replicas": 2}))
    held = [e for server in cfg.expert_servers for e in server.experts]
    assert sorted(held) == sorted(list(range(32)) * 2)
    assert all(len(set(s.experts)) == len(s.experts) for s in cfg.expert_servers)


def test_check_prints_every_part_in_start_order_without_the_token(tmp_path):
    path = tmp_path / "pd.yaml"
    path.write_text(yaml.safe_dump(config()))
    token = "deploy-check-token-f00d"
    result = deploy(str(path), "--check", env={**os.environ, "SGLANG_EAAS_TOKEN": token})
    assert result.returncode == 0, result.stderr
    names = re.findall(r"^  ([\w-]+): ", result.stdout, re.M)
    assert names == ["monitor", "expert-server-0", "expert-server-1", "prefill-0", "decode-0",
                     "router"]
    assert "--disaggregation-mode prefill" in result.stdout
    assert "--pd-disaggregation --prefill" in result.stdout
    assert token not in result.stdout


# -- stopping -----------------------------------------------------------------------------
def test_a_child_ignoring_sigterm_is_killed_with_its_children(tmp_path):
    stubborn = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, "
                "signal.SIG_IGN); subprocess.Popen([sys.executable, '-c', 'import signal, time; "
                "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); "
                "time.sleep(600)")
    child = Child("stubborn", [sys.executable, "-c", stubborn], "-", tmp_path / "s.log")
    child.start(dict(os.environ))
    deadline = time.monotonic() + 30
    while len(child.left()) < 2:  # itself and its child
        child.note_tree()
        assert time.monotonic() < deadline
        time.sleep(0.1)
    tree = child.left()
    t0 = time.monotonic()
    notes = stop_together([child], grace=1.0)
    assert 1.0 <= time.monotonic() - t0 < 15
    assert len(notes) == 1 and notes[0].startswith("stubborn: processes ")
    assert child.left() == []
    assert not [p for p in tree if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_a_part_that_cannot_start_stops_the_deployment_naming_it(tmp_path):
    """An expert server refusing its flags: the deployment says which part and where its log
    is, stops the monitor it started and exits 1."""
    path = tmp_path / "bad-server.yaml"
    path.write_text(yaml.safe_dump(config(expert_servers={"count": 2,
                                                          "args": ["--kernel", "nonsense"]})))
    result = deploy(str(path), "--log-dir", str(tmp_path / "logs"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(r"error: expert-server-\d \(pid \d+\) exited with code 2 while the "
                     r"deployment started; its log \S+expert-server-\d.log ends with:",
                     result.stderr), result.stderr
    assert "invalid choice: 'nonsense'" in result.stderr
    monitor = re.search(r"starting monitor on (\S+)", result.stdout).group(1)
    assert "deploy: stopped monitor" in result.stdout
    assert not accepts(monitor)
    assert not [p for p in psutil.process_iter(["cmdline"])
                if monitor in " ".join(p.info["cmdline"] or ())]


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed "
                    "(scripts/setup.sh installs Debian's etcd-server)")
def test_an_etcd_tier_is_stopped_when_an_sglang_instance_cannot_start(tmp_path):
    """etcd as the monitor, every expert on both servers: the servers register there, then the
    SGLang instance refuses a flag; the deployment names it and stops everything in reverse
    order, etcd's data folder removed."""
    path = tmp_path / "etcd.yaml"
    path.write_text(yaml.safe_dump(config(
        monitor="etcd", expert_servers={"count": 2, "replicas": 2},
        sglang={"args": ["--dtype", "float32", "--no-such-flag"]})))
    result = deploy(str(path), "--log-dir", str(tmp_path / "logs"), timeout=300)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "deploy: expert servers ready" in out
    assert re.search(r"^error: plain-0 \(pid \d+\) exited with code 2 while the deployment "
                     r"started; its log \S+plain-0.log ends with:$", result.stderr, re.M)
    assert "unrecognized arguments: --no-such-flag" in result.stderr
    assert out.index("stopping plain-0") < out.index(
        "stopping expert-server-0, expert-server-1") < out.index("stopping etcd")
    etcd = re.search(r"starting etcd on etcd://(\S+)", out).group(1)
    servers = re.search(r"starting 2 expert servers on (\S+), (\S+)\n", out).groups()
    assert not [p for p in psutil.process_iter(["cmdline"]) for address in (etcd, *servers)
                if address in " ".join(p.info["cmdline"] or ())]
    data_dir = re.search(r"data dir = (\S+)", (tmp_path / "logs" / "etcd.log").read_text())
    assert data_dir and not Path(data_dir.group(1)).exists()


# -- plans ---------------------------------------------------------------------------------
def test_a_placement_file_gives_each_server_its_experts_and_address(tmp_path):
    placement = tmp_path / "placement.yaml"
    placement.write_text("servers:\n  '127.0.0.1:7101': [0-15]\n")
    with pytest.raises(DeployConfigError, match=r"^expert_servers.placement: .*placement.yaml: "
                       r"server '127.0.0.1:7101' lists '0-15', which is not an expert id"):
        parse_config(config(expert_servers={"placement": str(placement)}))
    layers = {0: list(range(32)), 1: list(range(16)), 2: list(range(32)), 3: list(range(32))}
    placement.write_text(yaml.safe_dump({"servers": {
        "127.0.0.1:7101": list(range(32)), "127.0.0.1:7102": layers}}))
    cfg = parse_config(config(expert_servers={"placement": str(placement)}))
    assert [(s.name, s.listen, s.experts) for s in cfg.expert_servers] == [
        ("expert-server-0", "127.0.0.1:7101", list(range(32))),
        ("expert-server-1", "127.0.0.1:7102", layers)]


def test_log_files_name_each_part(tmp_path):
    """The parts' log files are NAME.log in --log-dir (what the table shows)."""
    from sglang_eaas.deploy import parts

    cfg = parse_config(config())
    logs = Path("/logs")
    ports = parts.Ports(set())
    monitor, url = parts.monitor_child(cfg, ports, logs, None)
    servers = parts.expert_server_children(cfg, url, ports, logs, "float32")
    sglang = parts.sglang_parts(cfg, url, ports, logs)
    router, _ = parts.router_child(cfg, sglang, ports, logs)
    children = [monitor, *servers, *(p.child for p in sglang), router]
    assert [c.log_path.name for c in children] == [
        "monitor.log", "expert-server-0.log", "expert-server-1.log", "prefill-0.log",
        "decode-0.log", "router.log"]
    listening = [int(c.address.rsplit(":", 1)[1].split()[0]) for c in children]
    assert len(set(listening)) == len(listening)


# -- SGLang's own parser, duplicate keys ---------------------------------------------------
def test_sglang_choices_are_checked_by_sglangs_own_parser():
    """The transfer backend and the instances' flags are refused as SGLang's parser would
    refuse them, before anything starts: its choices, not a copied list."""
    from sglang_eaas.deploy.config import sglang_choices, sglang_parser

    backends = sglang_choices("--disaggregation-transfer-backend")
    action = next(a for a in sglang_parser()._actions
                  if "--disaggregation-transfer-backend" in a.option_strings)
    assert backends == list(action.choices) and "mooncake_tcp" in backends
    with pytest.raises(DeployConfigError) as refused:
        parse_config(config(sglang={"args": SGLANG_ARGS, "prefill": {}, "decode": {},
                                    "transfer_backend": "nixl_x"}))
    assert str(refused.value) == (f"sglang.transfer_backend: 'nixl_x' is not one of SGLang's "
                                  f"transfer backends ({', '.join(backends)})")
    for backend in backends:  # each of SGLang's is taken
        cfg = parse_config(config(sglang={"prefill": {}, "decode": {},
                                          "transfer_backend": backend}))
        assert cfg.sglang.transfer_backend == backend
    with pytest.raises(DeployConfigError, match=r"^sglang.decode.args: SGLang's parser refuses "
                       r"it: --attention-backend: invalid choice: 'nonsense' \(choose from "):
        parse_config(config(sglang={"prefill": {}, "decode": {
            "args": ["--attention-backend", "nonsense"]}}))
    with pytest.raises(DeployConfigError, match=r"^sglang.args: SGLang's parser refuses it: "
                       r"--max-running-requests: invalid int value: 'many'$"):
        parse_config(config(sglang={"args": ["--max-running-requests", "many"], "plain": {}}))
    # a flag SGLang does not know is left to its launch, which names it (test_a_part_...)
    parse_config(config(sglang={"args": ["--no-such-flag"], "plain": {}}))


DUPLICATED = [
    ("model: M\nrouter:\n  port: 0\nrouter: {port: 1}\n",
     "router: given twice in {path}, at lines 2 and 4; give each key once"),
    ("model: M\nsglang:\n  prefill:\n    count: 1\n    count: 2\n  decode: {}\n",
     "sglang.prefill.count: given twice in {path}, at lines 4 and 5; give each key once"),
    ("model: M\nexpert_servers:\n  experts: [{a: 1, a: 2}]\n",
     "expert_servers.experts[0].a: given twice in {path}, at lines 3 and 3; give each key once"),
]


@pytest.mark.parametrize("text,sentence", DUPLICATED, ids=["top", "nested", "in a list"])
def test_a_key_given_twice_is_refused_naming_it_and_its_lines(tmp_path, text, sentence):
    path = tmp_path / "twice.yaml"
    path.write_text(text.replace("M", str(MODEL)))
    with pytest.raises(DeployConfigError) as refused:
        load_config(path)
    assert str(refused.value) == sentence.format(path=path)


# -- ports the config fixes: checked free before anything starts ------------------------------
def _listening() -> socket.socket:
    """A socket listening on a free loopback port: a port some other program serves."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def test_a_fixed_port_in_use_is_refused_naming_its_field(tmp_path):
    from sglang_eaas.deploy.ports import busy_port

    with _listening() as taken:
        port = taken.getsockname()[1]
        placement = tmp_path / "placement.yaml"
        placement.write_text(yaml.safe_dump({"servers": {
            f"127.0.0.1:{port}": list(range(32)), "127.0.0.1:1": list(range(32))}}))
        cases = [
            (config(router={"port": port}), f"router.port: port {port} is already in use"),
            (config(router={"args": ["--prometheus-port", str(port)]}),
             f"router.args (--prometheus-port): port {port} is already in use"),
            (config(sglang={"args": [f"--nccl-port={port}"], "plain": {}}),
             f"sglang.args (--nccl-port): port {port} is already in use"),
            (config(expert_servers={"placement": str(placement)}),
             f"expert_servers.placement (127.0.0.1:{port}): port {port} is already in use"),
        ]
        for data, sentence in cases:
            assert busy_port(parse_config(data)) == sentence
    free = port  # closed now
    assert busy_port(parse_config(config(router={"port": free}))) is None
    assert busy_port(parse_config(config(router={"port": free, "args": [
        "--prometheus-port", str(free)]}))) == (
        f"router.args (--prometheus-port): port {free} is also given by router.port; two parts "
        "cannot listen on one port")


def test_a_router_port_in_use_stops_the_command_before_anything_starts(tmp_path):
    """The user's case: router.port taken. One sentence before any part starts (not the
    router's traceback after the whole deployment started), exit status 1, no log folder."""
    from sglang_eaas.deploy import DeployError, Deployment

    with _listening() as taken:
        port = taken.getsockname()[1]
        cfg = parse_config(config(router={"port": port}))
        deployment = Deployment(cfg, tmp_path / "api-logs")
        with pytest.raises(DeployError, match=f"^router.port: port {port} is already in use$"):
            deployment.start()
        assert deployment.children() == [] and not (tmp_path / "api-logs").exists()
        path = tmp_path / "taken.yaml"
        path.write_text(yaml.safe_dump(config(router={"port": port})))
        result = deploy(str(path), "--log-dir", str(tmp_path / "logs"), timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr == f"error: router.port: port {port} is already in use\n"
    assert result.stdout == "deploy: did not start\n"
    assert not (tmp_path / "logs").exists()


# -- shared-memory files the parts leave ----------------------------------------------------
HOLDER = """
import mmap, os, sys, time
folder = sys.argv[1]
# as glibc's sem_open makes sem.mp-*: a temporary file mapped, linked under the name, unlinked
with open(os.path.join(folder, "sem.Xy12Zw"), "w+b") as f:
    f.truncate(4096)
    mapped = mmap.mmap(f.fileno(), 4096)
os.link(os.path.join(folder, "sem.Xy12Zw"), os.path.join(folder, "sem.mp-abcd1234"))
os.unlink(os.path.join(folder, "sem.Xy12Zw"))
loads = os.open(os.path.join(folder, "sglang_loads_x_0123abcd.shm"), os.O_CREAT | os.O_RDWR)
gone = os.path.join(folder, "unlinked")
with open(gone, "w+b") as f:
    f.truncate(4096)
    kept = mmap.mmap(f.fileno(), 4096)
os.unlink(gone)
print("ready", flush=True)
time.sleep(600)
"""


def test_the_shm_files_a_part_had_in_use_are_removed_after_it_ends(tmp_path):
    """A folder standing in for /dev/shm: the files a process had mapped or open (found from
    /proc while it ran) are removed once it has ended, as are pid-stamped files of its pid;
    a file another live process uses, a file replaced since, a file of another pid and any
    other file are left."""
    from sglang_eaas import shm_files as shm

    folder = tmp_path / "shm"
    folder.mkdir()
    folder = folder.resolve()  # as /proc names it
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "ready\n"
    used = shm.files_in_use(holder.pid, folder)
    assert sorted(used) == ["sem.mp-abcd1234", "sglang_loads_x_0123abcd.shm"]
    assert used["sem.mp-abcd1234"] == (folder / "sem.mp-abcd1234").stat().st_ino
    processes = {(holder.pid, psutil.Process(holder.pid).create_time()),
                 (os.getpid(), psutil.Process().create_time())}
    stamped = folder / f"ibgda-{holder.pid}-00ff"
    stamped.write_bytes(b"x")
    alive_stamped = folder / f"ibgda-{os.getpid()}-00ff"  # its creator lives
    alive_stamped.write_bytes(b"x")
    other_stamped = folder / "ibgda-999999999-00ff"  # not a pid of the deployment
    other_stamped.write_bytes(b"x")
    (folder / "unrelated").write_bytes(b"x")
    still_used = folder / "sem.mp-inuse000"  # the deployment had it; another process still has
    still_used.write_bytes(b"x")
    replaced = folder / "sem.mp-replaced"
    replaced.write_bytes(b"x")
    files = {**used, still_used.name: still_used.stat().st_ino,
             replaced.name: replaced.stat().st_ino}
    replaced.rename(folder / "renamed")  # the file lives on under another name ...
    replaced.write_bytes(b"another file, same name")  # ... so this one has another inode
    holder.kill()
    holder.wait()
    with open(still_used, "rb"):
        removed, left = shm.remove_left(files, processes, folder)
    assert sorted(removed) == [stamped.name, "sem.mp-abcd1234", "sglang_loads_x_0123abcd.shm"]
    assert left == [f"{still_used} is still in use by another process; left there"]
    assert sorted(os.listdir(folder)) == sorted([
        alive_stamped.name, other_stamped.name, "unrelated", still_used.name, replaced.name,
        "renamed"])
    assert shm.remove_left(files, processes, folder) == ([still_used.name], [])


def test_a_spawn_contexts_semaphore_is_found_under_its_name():
    """What SGLang leaves: a multiprocessing semaphore of a spawn context, in the real
    /dev/shm, is found under its sem.mp-* name though the process maps it as another."""
    import multiprocessing

    from sglang_eaas import shm_files as shm

    lock = multiprocessing.get_context("spawn").Lock()
    name = "sem." + lock._semlock.name.lstrip("/")
    assert name.startswith("sem.mp-")
    assert name in shm.files_in_use(os.getpid())
    assert (shm.SHM_DIR / name).stat().st_ino in shm.inodes_in_use()
    del lock  # its finalizer unlinks it


SGLANG_LIKE = """
import multiprocessing, sys, time, uuid
from sglang.srt.managers.load_snapshot import ShmLoadSnapshotWriter, shm_path_for
path = shm_path_for(uuid.uuid4().hex[:12])  # as a scheduler names it (PortArgs.instance_id)
writer = ShmLoadSnapshotWriter(path, 1, 0)
lock = multiprocessing.get_context("spawn").Lock()
print(path, "sem." + lock._semlock.name.lstrip("/"), flush=True)
time.sleep(600)
"""


def test_what_sglang_leaves_in_dev_shm_is_found_and_removed_after_a_sigkill():
    """SGLang's own load-snapshot writer and a spawn context's semaphore, in a process group
    then SIGKILLed as SGLang ends its processes: both files are left in /dev/shm, found from the
    process while it ran, and removed after it ended."""
    from sglang_eaas import shm_files as shm

    process = subprocess.Popen([sys.executable, "-c", SGLANG_LIKE], stdout=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        loads, sem = process.stdout.readline().split()
        loads = Path(loads).name
        assert loads.startswith("sglang_loads_") and sem.startswith("sem.mp-")
        files = shm.files_in_use(process.pid)
        assert loads in files and sem in files, files
        seen = {(process.pid, psutil.Process(process.pid).create_time())}
    finally:  # its multiprocessing resource tracker too, as SGLang's kill_process_tree does
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert (shm.SHM_DIR / loads).exists() and (shm.SHM_DIR / sem).exists()
    removed, left = shm.remove_left(files, seen)
    assert sorted(removed) == sorted([loads, sem]) and left == []
    assert not (shm.SHM_DIR / loads).exists() and not (shm.SHM_DIR / sem).exists()


def test_pid_stamped_names_are_read_as_their_makers_write_them():
    from sglang.srt.utils.stale_shm_cleanup import make_shm_name

    from sglang_eaas.shm_files import pid_stamp

    assert pid_stamp(make_shm_name("mq")) == os.getpid()
    assert pid_stamp(f"multi_tokenizer_args_{os.getpid()}") == os.getpid()
    assert pid_stamp(f"ibgda-{os.getpid()}-0a1b") == os.getpid()
    assert pid_stamp("sem.mp-x1y2z3w4") is None and pid_stamp("sglang_loads_a_b.shm") is None


# -- a full PD deployment -----------------------------------------------------------------
@dataclass
class Running:
    """The deploy command serving: its process, output lines, router URL and table."""

    command: subprocess.Popen
    lines: list[str]
    url: str
    table: dict[str, tuple[str, int]]  # part -> (address, pid)
    tree: list[tuple[int, float, list[str]]]  # every process under it, as seen so far
    shm_before: dict[str, int]  # every file in /dev/shm before it started: name -> inode
    shm_left: Path | None  # with a /dev/shm of its own: where the files it left are listed

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, line: str, timeout: float = 300) -> str:
        return _wait_for_line(self.command, self.lines, line, timeout)


@pytest.fixture(scope="module")
def pd_deployment(tmp_path_factory):
    """``python -m sglang_eaas.deploy`` on a PD config with every expert on both servers, as a
    user starts it; SIGKILLed at the end if a test left it running."""
    tmp = tmp_path_factory.mktemp("pd")
    path = tmp / "pd.yaml"
    # the monitor's default timings (a late heartbeat on these saturated cores is a suspicion)
    path.write_text(yaml.safe_dump(config(expert_servers={"count": 2, "replicas": 2,
                                                          "standby": 2})))
    shm_before = _shm_files()
    argv = [sys.executable, "-m", "sglang_eaas.deploy", str(path), "--log-dir", str(tmp / "logs")]
    shm_left = tmp / "shm-left.txt" if PRIVATE_SHM else None
    if shm_left:
        argv = ["unshare", "--mount", "--propagation", "private", sys.executable,
                str(Path(private_shm.__file__)), str(shm_left), *argv]
    command = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(command.stdout), daemon=True)
    reader.start()
    try:
        url = _wait_for_line(command, lines, "deploy: serving at ", timeout=900).split()[3]
        rows = re.findall(r"^([\w-]+) +(\S+).* (\d+) +\S+\.log$", "".join(lines), re.M)
        yield Running(command, lines, url, {name: (address, int(pid))
                                            for name, address, pid in rows}, _tree(command.pid),
                      shm_before, shm_left)
    finally:
        if command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)
        reader.join(10)


PRIVATE_SHM = private_shm.available()
# Without a /dev/shm of its own, the last test compares every file in /dev/shm: no other test
# may run from the deployment's start to then.
alone_unless_private_shm = pytest.mark.usefixtures() if PRIVATE_SHM else pytest.mark.alone


@alone_unless_private_shm
@pytest.mark.slow
@pytest.mark.cpu_only  # SGLang with --device cpu
def test_pd_deployment_serves_like_monolithic(pd_deployment, monolithic_trained):
    running = pd_deployment
    assert list(running.table) == ["monitor", "expert-server-0", "expert-server-1",
                                   "expert-server-2", "expert-server-3", "prefill-0",
                                   "decode-0", "router"], running.table
    assert {pid for _, pid in running.table.values()} <= {pid for pid, _, _ in running.tree}
    assert len(running.tree) > len(running.table)  # SGLang's schedulers and detokenizers too
    token = os.environ["SGLANG_EAAS_TOKEN"]
    assert not [cmd for _, _, cmd in running.tree if token in " ".join(cmd)]
    expected = [monolithic_trained.generate(p, NEW_TOKENS)["output_ids"] for p in PROMPTS]
    assert [_generate(running.url, p) for p in PROMPTS] == expected
    # Both instances are clients of the one pool: each server (the two standby ones too) has
    # the prefill's and the decode's rank joined.
    servers = [running.table[f"expert-server-{i}"][0] for i in range(4)]
    assert [probe(a, token).clients for a in servers] == [2, 2, 2, 2]
    assert [bool(probe(a, token).holdings.holds_any()) for a in servers] == [
        True, True, False, False]


@alone_unless_private_shm
@pytest.mark.slow
@pytest.mark.cpu_only  # SGLang with --device cpu
def test_an_expert_server_killed_during_pd_serving_loses_no_request_and_comes_back(
        pd_deployment, monolithic_trained):
    """With a CPU hog of twice the cores running throughout (a neighbour's job on these 2
    cores) and the monitor's default timings: eight streams through router -> prefill ->
    decode, again and again for NO_FAULT_SECONDS, change no token and cost no member (no loss
    of any kind at the monitor); then expert-server-0 is SIGKILLed while they decode: the other
    holder of every expert takes its tokens mid-layer, no request fails and no token changes;
    the deployment starts it again and it rejoins the tier."""
    running = pd_deployment
    expected = concurrent_streams(monolithic_trained.url, STREAMS, STREAM_TOKENS)
    _, victim = running.table["expert-server-0"]
    monitor = connect(running.table["monitor"][0], os.environ["SGLANG_EAAS_TOKEN"])

    def kill():
        time.sleep(0.3)  # a few decode steps in
        os.kill(victim, signal.SIGKILL)

    def losses() -> dict[str, int]:
        return {k: v for k, v in monitor.stats().counters.items() if k.startswith("losses_")}

    try:
        with Hog():
            before, rounds = losses(), 0
            deadline = time.monotonic() + NO_FAULT_SECONDS
            while time.monotonic() < deadline:
                assert concurrent_streams(running.url, STREAMS, STREAM_TOKENS) == expected
                rounds += 1
            assert losses() == before, (before, losses(), rounds)
            assert concurrent_streams(running.url, STREAMS, STREAM_TOKENS, kill) == expected
            running.wait_for("deploy: expert-server-0 is back")
    finally:
        monitor.close()
    assert f"deploy: expert-server-0 (pid {victim}) exited with code -9 while serving; " \
        "starting it again (1 of 3)" in running.output()
    running.tree += _tree(running.command.pid)  # the new server's processes
    assert concurrent_streams(running.url, STREAMS[:2], STREAM_TOKENS) == expected[:2]


@alone_unless_private_shm
@pytest.mark.slow
@pytest.mark.cpu_only  # SGLang with --device cpu
def test_the_tools_fail_within_seconds_given_each_others_ports(pd_deployment, capsys):
    """SGLang's HTTP port given to ``tools.switch`` as the monitor, the monitor's given to
    ``tools.scale`` as SGLang's: one sentence each, within a few seconds."""
    from sglang_eaas.tools import scale, switch

    token = os.environ["SGLANG_EAAS_TOKEN"]
    decode = pd_deployment.table["decode-0"][0]
    monitor = pd_deployment.table["monitor"][0]
    began = time.monotonic()
    assert switch.main(["--monitor", decode.removeprefix("http://"), "--model-path",
                        str(MODEL), "--to", "tp", "--token", token]) == 1
    err = capsys.readouterr().err
    assert time.monotonic() - began < 10 and err.count("\n") == 1, err
    assert "did not answer within 5s" in err or "not an sglang-eaas monitor" in err, err
    began = time.monotonic()
    assert scale.main([f"http://{monitor}", "to", "3", "--token", token]) == 1
    err = capsys.readouterr().err
    assert time.monotonic() - began < 10 and err.count("\n") == 1, err
    assert "SGLang's HTTP port" in err, err


CHAOS_SECONDS = 90  # how long the actors change the tier at once
NO_FAULT_SECONDS = 60  # serving under a CPU hog with no fault, before the kill


class Actors:
    """What the actors of the concurrency test did: each call's outcome, by actor."""

    def __init__(self):
        self.lock = threading.Lock()
        self.outcomes: list[tuple[str, str, str]] = []  # (actor, asked, outcome)
        self.errors: list[str] = []  # what no actor may see (a traceback, an odd status)
        self.op_ids: list[str] = []

    def note(self, actor: str, asked: str, outcome: str, op_id: str = "") -> None:
        with self.lock:
            self.outcomes.append((actor, asked, outcome))
            if op_id:
                self.op_ids.append(op_id)

    def count(self, outcome: str) -> int:
        return sum(o == outcome for _, _, o in self.outcomes)


def _admin(url: str, token: str, body: dict | None = None, path: str = "/eaas/scale"):
    headers = {"X-Eaas-Token": token}
    if body is None:
        return requests.get(url + path, headers=headers, timeout=60)
    return requests.post(url + path, json=body, headers=headers, timeout=60)


@alone_unless_private_shm
@pytest.mark.slow
@pytest.mark.cpu_only  # SGLang with --device cpu
def test_operations_from_many_actors_at_once_are_serialised_and_lose_no_request(
        pd_deployment, monolithic_trained, capsys, tmp_path):
    """For CHAOS_SECONDS, at once: the admin APIs of the prefill and the decode instance,
    ``tools.scale``, ``tools.switch``, ``tools.rebalance`` and the autoscaler's endpoint send
    random operations (out-of-bound ones among them), a ``tools.switch`` process is SIGKILLed
    mid-switch, and eight streams decode through the router the whole time. Then a checker over
    the monitor's recorded history: every operation ended (done, failed or rolled back), none
    overlapped another, each is readable from both instances; no request failed and every
    token equals monolithic SGLang's; every snapshot the monitor showed had a live holder for
    every expert; the tier ends as the last operation recorded it."""
    import random

    from sglang_eaas.controller.end_state import end_state
    from sglang_eaas.elastic.switch import layouts
    from sglang_eaas.membership import connect, current_snapshot
    from sglang_eaas.model_info import MoeModelInfo
    from sglang_eaas.protocol.operations import DONE, FINAL
    from sglang_eaas.routing_table import uncovered
    from sglang_eaas.tools import rebalance, scale, switch  # their main(), in threads

    running = pd_deployment
    token = os.environ["SGLANG_EAAS_TOKEN"]
    monitor = running.table["monitor"][0]
    fronts = [running.table["prefill-0"][0], running.table["decode-0"][0]]
    info = MoeModelInfo.from_model_path(MODEL)
    expected = concurrent_streams(monolithic_trained.url, STREAMS, STREAM_TOKENS)
    actors, stop = Actors(), threading.Event()
    rounds, failures, gaps = [], [], []

    def decode():
        while not stop.is_set():
            try:
                rounds.append(concurrent_streams(running.url, STREAMS, STREAM_TOKENS)
                              == expected)
            except Exception as exc:  # noqa: BLE001 - every failure is the test's finding
                failures.append(repr(exc))

    def watch():  # every revision the monitor shows must have a live holder for each expert
        backend, after = connect(monitor, token), -1
        try:
            while not stop.is_set():
                snapshot = backend.watch(after, 1.0)
                after = snapshot.revision
                held = snapshot.holdings(info.fingerprint()).model_experts(info.num_experts)
                missing = uncovered(held, list(info.moe_layers), info.num_experts)
                if missing:
                    gaps.append((snapshot.revision, missing))
        finally:
            backend.close()

    def serving() -> list[str]:
        return [m.id for m in current_snapshot(monitor, token).servers()]

    def admin_actor(name: str, url: str, rng: random.Random):
        while not stop.is_set():
            if rng.random() < 0.3:  # out of bounds: refused before anything starts
                body = rng.choice([{"servers": 1000}, {"servers": 0}, {"servers": 40},
                                   {"retire": ["127.0.0.1:1"]}])
                reply = _admin(url, token, body)
                actors.note(name, str(body), f"http {reply.status_code}")
                if reply.status_code != 400 or len(reply.json()["error"].splitlines()) != 1:
                    actors.errors.append(f"{name}: {body} -> {reply.status_code} {reply.text}")
            else:
                body = (rng.choice([{"servers": n} for n in (2, 3, 4)]) if rng.random() < 0.7
                        else {"retire": [rng.choice(serving())], "replace": True})
                reply = _admin(url, token, body)
                op = reply.json()
                actors.note(name, str(body), f"http {reply.status_code}", op.get("id", ""))
                if reply.status_code == 409:  # one sentence naming the running operation
                    if "operation" not in op["error"] or "\n" in op["error"]:
                        actors.errors.append(f"{name}: {body} -> 409 {op}")
                elif reply.status_code not in (202, 400):  # 400: a bound, as the tier is now
                    actors.errors.append(f"{name}: {body} -> {reply.status_code} {reply.text}")
            stop.wait(rng.uniform(0.5, 2.0))

    def tool_actor(name: str, rng: random.Random):
        while not stop.is_set():
            kind = rng.choice(["scale", "switch", "rebalance", "autoscale"])
            try:
                if kind == "scale":
                    argv = [rng.choice(fronts), "to", str(rng.choice((2, 3, 4))), "--token",
                            token, "--timeout", "300"]
                    code = scale.main(argv)
                elif kind == "switch":
                    to = rng.choice(["tp", "ep"])
                    code = switch.main(["--monitor", monitor, "--model-path", str(MODEL),
                                        "--token", token, "--to", to,
                                        *(["--parts", "2"] if to == "tp" else [])])
                elif kind == "rebalance":
                    code = rebalance.main(["--monitor", monitor, "--token", token,
                                           "--state", str(state)])
                else:
                    reply = _admin(fronts[1], token, {
                        "direction": rng.choice(["out", "in"]), "reason": "chaos",
                        "min_servers": 2, "max_servers": 4, "act": "resize"},
                        path="/eaas/autoscale")
                    code = reply.status_code
            except SystemExit as exc:
                code = f"exit {exc.code}"
            except Exception as exc:  # noqa: BLE001 - a tool must not raise
                actors.errors.append(f"{name} {kind}: {exc!r}")
                code = "raised"
            actors.note(name, kind, str(code))
            stop.wait(rng.uniform(0.5, 2.0))

    def killer():  # a switch's driver SIGKILLed mid-switch
        stop.wait(CHAOS_SECONDS / 3)
        # tried until one is killed mid-switch (a switch another actor made first ends before
        # its first layer), past the others' stop on a slow host
        deadline = time.monotonic() + 3 * CHAOS_SECONDS
        while time.monotonic() < deadline:
            now = layouts(current_snapshot(monitor, token).holdings(info.fingerprint()), info)
            to = "ep" if 2 in now.values() else "tp"
            driver = subprocess.Popen(
                [sys.executable, "-m", "sglang_eaas.tools.switch", "--monitor", monitor,
                 "--model-path", str(MODEL), "--to", to, "--wait", "60",
                 *(["--parts", "2"] if to == "tp" else [])],
                env={**os.environ, "SGLANG_EAAS_OPERATION_LEASE": "3"},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for line in driver.stdout:
                if line.startswith("MoE layer "):
                    driver.kill()
                    actors.note("killer", f"switch to {to}", "killed")
                    driver.wait()
                    return
            driver.wait()
            actors.note("killer", f"switch to {to}", f"ended {driver.returncode} first")

    state = tmp_path / "rebalance-state.json"
    threads = [threading.Thread(target=decode), threading.Thread(target=watch),
               threading.Thread(target=admin_actor, args=("prefill admin", fronts[0],
                                                          random.Random(1))),
               threading.Thread(target=admin_actor, args=("decode admin", fronts[1],
                                                          random.Random(2))),
               threading.Thread(target=tool_actor, args=("tools", random.Random(3))),
               threading.Thread(target=tool_actor, args=("more tools", random.Random(4))),
               threading.Thread(target=killer)]
    for t in threads:
        t.start()
    try:
        stop.wait(CHAOS_SECONDS)
    finally:
        stop.set()
        for t in threads:
            t.join(600)
    # the next operation finishes or rolls back what a killed driver left, as a user's next one
    # would (a kill near the end leaves its record to it)
    final = subprocess.run([sys.executable, "-m", "sglang_eaas.tools.switch", "--monitor", monitor,
                            "--model-path", str(MODEL), "--to", "ep", "--wait", "120"],
                           capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stdout + final.stderr
    capsys.readouterr()  # the tools' output
    # the history, as the monitor recorded it (newest first there)
    backend = connect(monitor, token)
    try:
        listed = backend.operations("", 256)
    finally:
        backend.close()
    history = sorted(listed.operations, key=lambda r: r.epoch)
    summary = [(r.id, r.kind, r.state, r.result[:80]) for r in history]
    assert not listed.holder, f"an operation still holds the tier: {listed.holder}"
    assert all(r.state in FINAL for r in history), summary
    own = [r for r in history if "lease lapsed" not in r.result]
    for before, after in zip(own, own[1:]):
        assert before.finished_at <= after.started_at + 0.05, (before, after)
    recovered = [r for r in history if "lease lapsed" in r.result]
    assert ("killer", "switch to tp", "killed") in actors.outcomes or (
        "killer", "switch to ep", "killed") in actors.outcomes, actors.outcomes[-5:]
    assert recovered and all(r.requester.startswith("tools.switch") for r in recovered), summary
    assert sum(r.state == DONE for r in history) >= 5, summary
    assert actors.count("http 409") >= 2, actors.outcomes  # they did come at once
    assert actors.count("http 400") >= 3
    assert not actors.errors, actors.errors[:3]
    # every operation (of the latest the monitor keeps) is readable from either instance
    kept = {r.id for r in history}
    for op_id in [i for i in actors.op_ids if i in kept][-20:]:
        records = [_admin(front, token, path=f"/eaas/operations/{op_id}").json()
                   for front in fronts]
        assert records[0] == records[1] and records[0].get("state") in FINAL, records
    # the requests
    assert not failures, failures[:3]
    assert len(rounds) >= 2 and all(rounds), rounds
    assert not gaps, gaps[:3]
    # the tier ends as the last operation read it back
    last = history[-1]
    now = end_state(current_snapshot(monitor, token), info.fingerprint())
    assert now["holdings"] == last.end["holdings"], (last, now)
    if last.state == DONE and last.kind == "resize":
        assert len(now["active"]) == last.target["servers"], (last, now)


@alone_unless_private_shm
@pytest.mark.slow
@pytest.mark.cpu_only  # SGLang with --device cpu
def test_sigterm_stops_the_deployment_in_order_leaving_nothing(pd_deployment):
    running = pd_deployment
    running.command.send_signal(signal.SIGTERM)
    assert running.command.wait(180) == 0, running.output()
    time.sleep(0.5)  # the reader thread takes the last lines
    output = running.output()
    assert output.index("deploy: stopping router") < output.index(
        "deploy: stopping prefill-0, decode-0") < output.index(
        "deploy: stopping expert-server-0, expert-server-1") < output.index(
        "deploy: stopping monitor")
    assert output.rstrip().endswith("deploy: stopped, no process or shared-memory file left")
    left = [(pid, cmd) for pid, created, cmd in running.tree if alive(pid, created)]
    assert not left
    if running.shm_left:  # its own /dev/shm: every file there is one it left
        assert running.shm_left.read_text() == "", running.shm_left.read_text()
        assert not accepts(running.url.removeprefix("http://"))
        return
    # Every file in /dev/shm now that was not there before the deployment started (the same
    # name and inode) is a leak, whoever made it, unless a live process has it mapped or open:
    # then it is that process's (the deployment's are all gone, checked above), e.g. the
    # monolithic SGLang these tests compare with, started after the deployment. A file another
    # program made and left meanwhile would fail the test too: on a machine running only the
    # suite there is none, and excusing files by name or age would let the deployment's own
    # through.
    new = {name: inode for name, inode in _shm_files().items()
           if running.shm_before.get(name) != inode}
    used = _shm_inodes_in_use()
    leaked = sorted(name for name, inode in new.items() if inode not in used)
    assert not leaked, (leaked, [line for line in output.splitlines() if "/dev/shm" in line])
    assert not accepts(running.url.removeprefix("http://"))


def _shm_files() -> dict[str, int]:
    """Every file in /dev/shm now: name -> inode."""
    files = {}
    for entry in os.scandir("/dev/shm"):
        try:
            files[entry.name] = entry.inode()
        except OSError:
            pass
    return files


def _shm_inodes_in_use() -> set[int]:
    """Inodes of the /dev/shm files some live process has mapped or open, read here from
    /proc/PID/maps and /proc/PID/fd (by inode: a semaphore is mapped under the name of the
    temporary file sem_open made it as, unlinked since)."""
    used = set()
    for pid in psutil.pids():
        try:
            with open(f"/proc/{pid}/maps") as maps:
                used |= {int(line.split()[4]) for line in maps if " /dev/shm/" in line}
            fds = os.listdir(f"/proc/{pid}/fd")
        except (OSError, ValueError):
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/"):
                    used.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
            except OSError:
                pass
    return used


def _wait_for_line(command: subprocess.Popen, lines: list[str], start: str,
                   timeout: float) -> str:
    """The first line of the deploy command's output that begins with ``start``, once it comes;
    fails when the command exits or ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        for line in list(lines):
            if line.startswith(start):
                return line
        assert command.poll() is None, "deploy exited:\n" + "".join(lines)
        assert time.monotonic() < deadline, f"no {start!r} in time:\n" + "".join(lines)
        time.sleep(0.2)


def _tree(pid: int) -> list[tuple[int, float, list[str]]]:
    """Every process under ``pid`` now: (pid, create time, command line)."""
    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            out.append((p.pid, p.create_time(), p.cmdline()))
        except psutil.Error:
            pass
    return out




def _generate(url: str, prompt: str) -> list[int]:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": NEW_TOKENS,
                                                 "temperature": 0.0, "ignore_eos": True}}
    reply = requests.post(f"{url}/generate", json=body, timeout=300)
    reply.raise_for_status()
    return reply.json()["output_ids"]


