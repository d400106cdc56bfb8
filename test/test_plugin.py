"""The plugin loads through SGLang's entry points; its flags parse and travel to workers."""

from __future__ import annotations

import multiprocessing
import pickle
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from sglang_eaas import plugin
from sglang_eaas.config import EaasConfig, LocalServers, RemoteServers
from sglang_eaas.placement import load_placement_file


@pytest.fixture(scope="module")
def sglang_with_plugins():
    """SGLang's own plugin loading, in this process, as the launcher does it."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    assert plugin.unapplied_hooks() == []


def _parse(model, *args: str):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(["--model-path", str(model), *args])


def test_entry_point_is_registered():
    (ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "eaas"]
    assert ep.value == "sglang_eaas.plugin:register"


def test_help_lists_every_flag():
    help_text = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True,
        text=True, check=True,
    ).stdout
    assert "sglang-eaas:" in help_text
    for flag, words in [("--eaas ", "stateless expert servers"),
                        ("--eaas-expert-servers SPEC", "local:N"),
                        ("--eaas-placement FILE", "replicas allowed"),
                        ("--eaas-poll-spin-us US", "busy-poll for the results")]:
        assert flag in help_text
        assert words in " ".join(help_text.split())


def test_flags_parse(sglang_with_plugins, tiny_qwen3):
    assert not hasattr(_parse(tiny_qwen3), "_eaas")
    assert _parse(tiny_qwen3, "--eaas")._eaas == EaasConfig()
    assert _parse(tiny_qwen3, "--eaas", "--eaas-disable-overlap")._eaas == EaasConfig(
        overlap=False)
    placement = tiny_qwen3.parent / "placement-parse.json"
    placement.write_text('{"servers": {"10.0.0.1:7000": [0, 1, 2, 3], '
                         '"node-b:7001": [4, 5, 6, 7]}}')
    args = _parse(tiny_qwen3, "--eaas", "--eaas-expert-servers", "10.0.0.1:7000, node-b:7001",
                  "--eaas-placement", str(placement), "--eaas-poll-spin-us", "0")
    assert args._eaas == EaasConfig(RemoteServers(("10.0.0.1:7000", "node-b:7001")),
                                    load_placement_file(placement), poll_spin_us=0)
    dump = tiny_qwen3.parent / "load.jsonl"  # need not exist: its folder must be writable
    assert _parse(tiny_qwen3, "--eaas", "--eaas-load-dump", str(dump), "--eaas-load-window",
                  "4")._eaas == EaasConfig(load_dump=dump, load_window=4)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--eaas", "--eaas-expert-servers", "local:0"], "'local:N' needs a whole number N >= 1"),
        (["--eaas", "--eaas-expert-servers", "node-a"], "'node-a' is not HOST:PORT"),
        (["--eaas", "--eaas-expert-servers", "a:99999"], "'a:99999': port 99999 is not in"),
        (["--eaas", "--eaas-expert-servers", "h:1:2"], "'h:1:2' is not HOST:PORT"),
        (["--eaas", "--eaas-expert-servers", "[::1]:7000"], "IPv6 addresses are not supported"),
        (["--eaas", "--eaas-expert-servers", "::1:7000"], "IPv6 addresses are not supported"),
        (["--eaas", "--eaas-expert-servers", "bad_host!:7000"], "is neither an IPv4 address"),
        (["--eaas", "--eaas-expert-servers", "a:7000,a:7000"], "names an expert server twice"),
        (["--eaas", "--eaas-placement", "/no/such/file"], "'/no/such/file' is not a readable"),
        (["--eaas-expert-servers", "local:2"], "--eaas-expert-servers only apply with --eaas"),
        (["--eaas", "--tp", "2", "--ep", "2"], "--eaas replaces expert parallelism"),
        (["--eaas", "--eaas-poll-spin-us", "-5"], "expected a whole number of microseconds"),
        (["--eaas-poll-spin-us", "10"], "--eaas-poll-spin-us only apply with --eaas"),
        (["--eaas", "--eaas-monitor", "zk://h:1"], "the only monitor URL scheme is etcd://"),
        (["--eaas", "--eaas-monitor", "embedded:h"], "monitor 'embedded:h': 'h' is not HOST"),
        (["--eaas", "--eaas-monitor", "etcd://[::1]:2379"], "IPv6 addresses are not supported"),
        (["--eaas", "--eaas-heartbeat", "0"], "expected a number of seconds > 0, got '0'"),
        (["--eaas", "--eaas-result-timeout", "nan"], "expected a number of seconds > 0"),
        (["--eaas", "--eaas-heartbeat", "1", "--eaas-suspect-timeout", "1.5"],
         "--eaas-heartbeat 1.0 must be at most half of the suspect timeout"),
        (["--eaas", "--eaas-suspect-timeout", "3", "--eaas-loss-timeout", "2"],
         "--eaas-suspect-timeout 3.0 must be at most the loss timeout (2.0s"),
        (["--eaas", "--eaas-monitor", "h:1", "--eaas-loss-timeout", "2"],
         "--eaas-loss-timeout applies to an embedded monitor"),
        (["--eaas", "--eaas-monitor", "h:1", "--eaas-suspect-timeout", "2"],
         "--eaas-suspect-timeout applies to an embedded monitor"),
        (["--eaas", "--eaas-wait-for-servers", "5"],
         "--eaas-wait-for-servers applies to a shared monitor"),
        (["--eaas-monitor", "h:1"], "--eaas-monitor only apply with --eaas"),
        (["--eaas-disable-overlap"], "--eaas-disable-overlap only apply with --eaas"),
        (["--eaas", "--eaas-load-window", "0"], "expected a whole number of steps >= 1, got '0'"),
        (["--eaas", "--eaas-load-window", "2.5"], "expected a whole number of steps >= 1"),
        (["--eaas", "--eaas-load-dump", "/no/such/dir/load.jsonl"],
         "cannot write to '/no/such/dir/load.jsonl': its folder '/no/such/dir' does not exist"),
        (["--eaas", "--eaas-load-dump", "/tmp"], "cannot write to '/tmp': '/tmp' is a directory"),
        (["--eaas-load-dump", "/tmp/load.jsonl", "--eaas-load-window", "3"],
         "--eaas-load-dump, --eaas-load-window only apply with --eaas"),
        (["--eaas", "--eaas-disable-overlap", "--enable-two-batch-overlap"],
         "--eaas-disable-overlap turns off the two-batch overlap --enable-two-batch-overlap "
         "asks for: drop one of them"),
    ],
)
def test_bad_values_are_refused(sglang_with_plugins, tiny_qwen3, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        _parse(tiny_qwen3, *args)
    assert exc.value.code not in (0, None)
    assert message in capsys.readouterr().err + str(exc.value.code)


def test_eaas_turns_two_batch_overlap_on_where_it_runs(sglang_with_plugins, tiny_qwen3,
                                                      tiny_mixtral, monkeypatch):
    """--eaas turns SGLang's two-batch overlap on for Qwen3-MoE at --tp 1 (all-to-all backend
    'customized': the expert servers), unless local expert servers share the ranks' cores;
    --eaas-disable-overlap, other models and --tp > 1 serve without it, saying why (a warning
    when --enable-two-batch-overlap asked for it)."""
    from sglang_eaas import cores
    from sglang_eaas.client import overlap as eaas_overlap

    said = []
    for level in ("info", "warning"):
        monkeypatch.setattr(eaas_overlap.logger, level,
                            lambda msg, *a, level=level: said.append((level, msg % a)))

    def overlap(model, *args):
        parsed = _parse(model, *args)
        return parsed.enable_two_batch_overlap, parsed.moe_a2a_backend

    monkeypatch.setattr(cores, "usable_cores", lambda: 64)
    assert overlap(tiny_qwen3) == (False, "none")
    assert overlap(tiny_qwen3, "--eaas") == (True, "customized")
    assert overlap(tiny_qwen3, "--eaas", "--enable-two-batch-overlap") == (True, "customized")
    assert overlap(tiny_qwen3, "--eaas", "--eaas-disable-overlap") == (False, "none")
    assert said == []
    assert overlap(tiny_mixtral, "--eaas") == (False, "none")
    assert overlap(tiny_qwen3, "--eaas", "--tp", "2", "--enable-two-batch-overlap") == (
        False, "none")
    (mixtral, tp2) = said
    assert mixtral[0] == "info" and "not for model type mixtral" in mixtral[1]
    assert tp2[0] == "warning" and "with --tp > 1" in tp2[1]

    said.clear()
    monkeypatch.setattr(cores, "usable_cores", lambda: 2)  # 2 local servers + 1 rank
    assert overlap(tiny_qwen3, "--eaas") == (False, "none")
    assert said == [("info", "sglang-eaas: serving without two-batch overlap: the 2 local "
                     "expert servers and 1 rank(s) share 2 cores, where overlap would make the "
                     "servers read every active expert's weights once per micro-batch with no "
                     "idle core to hide it in (--enable-two-batch-overlap turns it on)")]
    assert overlap(tiny_qwen3, "--eaas", "--eaas-expert-servers", "local:1") == (
        True, "customized")
    assert overlap(tiny_qwen3, "--eaas", "--eaas-expert-servers", "h:1") == (True, "customized")
    assert overlap(tiny_qwen3, "--eaas", "--enable-two-batch-overlap") == (True, "customized")


def test_local_ranks_do_not_spin_where_servers_share_the_cores(monkeypatch):
    from sglang_eaas import cores
    from sglang_eaas.launcher import prepare
    from sglang_eaas.protocol.slot import POLL_SPIN_US

    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    assert prepare.client_poll_spin_us(None, servers=2, ranks=1) == 0
    assert prepare.client_poll_spin_us(None, servers=1, ranks=1) == POLL_SPIN_US
    assert prepare.client_poll_spin_us(300, servers=2, ranks=1) == 300
    assert prepare.client_poll_spin_us(0, servers=1, ranks=1) == 0


def test_ranks_leave_the_local_servers_their_cores(monkeypatch):
    """A rank's torch threads are the cores the local expert servers (one thread each) leave,
    split over the ranks, at least one; without local servers SGLang's choice stands."""
    from sglang_eaas import cores

    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    assert cores.rank_threads(2, 1) == 1 and cores.rank_threads(1, 1) == 1
    assert cores.rank_threads(2, 2) == 1 and cores.rank_threads(0, 1) is None
    monkeypatch.setattr(cores, "usable_cores", lambda: 16)
    assert cores.rank_threads(2, 1) == 14 and cores.rank_threads(4, 2) == 6


def test_eaas_refused_when_a_hook_did_not_apply(sglang_with_plugins, tiny_qwen3, capsys,
                                                monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry

    target = plugin.HOOKS[-1].target
    monkeypatch.setattr(HookRegistry, "_patched", HookRegistry._patched - {target})
    with pytest.raises(SystemExit):
        _parse(tiny_qwen3, "--eaas")
    err = capsys.readouterr().err
    assert "sglang-eaas plugin is not active" in err and target in err


def _unpickle_in_child(payload: bytes, queue) -> None:
    try:
        queue.put(("ok", pickle.loads(payload)._eaas))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        queue.put(("error", str(exc)))


def _spawn_unpickle(payload: bytes):
    """Unpickle in a spawned process: how SGLang hands ServerArgs to its schedulers."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_unpickle_in_child, args=(payload, queue))
    child.start()
    result = queue.get(timeout=120)
    child.join(60)
    return result


def test_config_reaches_spawned_workers(sglang_with_plugins, tiny_qwen3):
    args = _parse(tiny_qwen3, "--eaas", "--eaas-expert-servers", "local:3",
                  "--eaas-poll-spin-us", "50")
    assert _spawn_unpickle(pickle.dumps(args)) == ("ok", EaasConfig(LocalServers(3),
                                                                    poll_spin_us=50))


def test_worker_without_the_plugin_fails_clearly(sglang_with_plugins, tiny_qwen3, monkeypatch):
    payload = pickle.dumps(_parse(tiny_qwen3, "--eaas"))
    monkeypatch.setenv("SGLANG_PLUGINS", "some_other_plugin")  # SGLang's plugin allow-list
    status, message = _spawn_unpickle(payload)
    assert status == "error"
    assert "sglang-eaas plugin is not active" in message and "SGLANG_PLUGINS" in message


def test_launcher_without_the_plugin_refuses_eaas(tiny_qwen3):
    result = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(tiny_qwen3), "--eaas"],
        capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "SGLANG_PLUGINS": "some_other_plugin"},
    )
    assert result.returncode != 0
    assert "unrecognized arguments: --eaas" in result.stderr



def test_planned_local_servers(tmp_path):
    """How many expert servers the launcher will start, as the overlap and spin defaults need
    it before the launch: local:N, the default 2, a placement's local entries, or none."""
    from sglang_eaas.cores import planned_local_servers
    from sglang_eaas.membership import parse_monitor

    local = tmp_path / "local.json"
    local.write_text('{"servers": {"local:0": [0, 1], "local:1": [2, 3], "local:2": [0]}}')
    remote = tmp_path / "remote.json"
    remote.write_text('{"servers": {"a:1": [0, 1], "b:1": [2, 3]}}')
    local, remote = load_placement_file(local), load_placement_file(remote)
    assert planned_local_servers(EaasConfig()) == 2
    assert planned_local_servers(EaasConfig(LocalServers(3))) == 3
    assert planned_local_servers(EaasConfig(RemoteServers(("a:1",)))) == 0
    assert planned_local_servers(EaasConfig(monitor=parse_monitor("h:2379"))) == 0
    assert planned_local_servers(EaasConfig(placement=local)) == 3
    assert planned_local_servers(EaasConfig(placement=remote)) == 0


def test_an_esft_random_adapter_made_with_defaults_is_served_with_defaults(
        sglang_with_plugins, tiny_qwen3, tmp_path):
    """The tool's default and the server's agree: on an 8-expert model ``esft random``
    replaces at most a quarter of the experts per layer (2), which is what
    ``--eaas-esft-max-experts`` takes by default; the launch checks the adapter with it."""
    from sglang_eaas.esft.adapter import load_adapter
    from sglang_eaas.model_info import MoeModelInfo
    from sglang_eaas.tools.esft import main as esft_tool

    assert esft_tool(["random", str(tiny_qwen3), str(tmp_path / "a")]) == 0
    info = MoeModelInfo.from_model_path(tiny_qwen3)
    adapter = load_adapter(tmp_path / "a", info)
    cfg = _parse(tiny_qwen3, "--eaas", "--eaas-esft-adapters", f"a={tmp_path / 'a'}")._eaas
    assert {len(ids) for ids in adapter.experts.values()} == {cfg.adapter_budget(8)} == {2}
    assert info.num_experts == 8
