"""Bad input at the edges is refused with one sentence naming what is wrong: placement files,
expert-server addresses, dtype spellings."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from sglang_eaas.addresses import Address, AddressError, parse_address
from sglang_eaas.placement import PlacementError, load_placement_file
from sglang_eaas.protocol.slot import dtype_name


@pytest.mark.parametrize("name, content, message", [
    ("broken.yaml", b"servers:\n  local:0: [0, 1\n  local:1: [2]\n",
     "not valid JSON or YAML at line"),
    ("broken.json", b'{"servers": {"local:0": [0, 1]', "not valid JSON"),
    ("latin1.yaml", "servers:\n  local:0: [0]  # caf\u00e9\n".encode("latin-1"),
     "not UTF-8 text (byte"),
    ("bools.json", b'{"servers": {"local:0": [true, false]}}',
     "server 'local:0' lists True, which is not an expert id"),
    ("negative.json", b'{"servers": {"local:0": [0, -1]}}', "lists -1, which is not an expert"),
    ("float.yaml", b"servers:\n  local:0: [0, 1.5]\n", "lists 1.5, which is not an expert"),
    ("twice.yaml", b"servers:\n  local:0: [0, 1, 1, 2, 0]\n",
     "server 'local:0' lists experts [0, 1] more than once"),
    ("empty.json", b'{"servers": {"local:0": []}}', "must map to a non-empty list"),
    ("string.json", b'{"servers": {"local:0": "0-3"}}', "must map to a non-empty list"),
    ("ipv6.json", b'{"servers": {"[::1]:7000": [0]}}', "IPv6 addresses are not supported"),
    ("badname.json", b'{"servers": {"local:x": [0]}}', "'local:N', N a number"),
    ("mixed.json", b'{"servers": {"local:0": [0], "10.0.0.1:7000": [1]}}',
     "mixes local:N servers with separately started ones"),
    ("list.yaml", b"- 0\n- 1\n", "expected a 'servers' map"),
])
def test_bad_placement_files_name_the_file_and_the_entry(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(PlacementError) as exc:
        load_placement_file(path)
    assert str(path) in str(exc.value) and message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_good_placement_files_still_load(tmp_path):
    (tmp_path / "p.yaml").write_text("servers:\n  'node-a:7000': [3, 0]\n  node-b:7001: [1, 2]\n")
    assert load_placement_file(tmp_path / "p.yaml").entries == {"node-a:7000": [0, 3],
                                                                 "node-b:7001": [1, 2]}
    (tmp_path / "p.json").write_text(json.dumps({"servers": {"local:0": [1], "local:1": [0]}}))
    assert load_placement_file(tmp_path / "p.json").entries == {"local:0": [1], "local:1": [0]}


@pytest.mark.parametrize("text, message", [
    ("[::1]:7000", "IPv6 addresses are not supported"),
    ("::1", "IPv6 addresses are not supported"),
    ("h:1:2", "is not HOST:PORT"),
    ("host", "is not HOST:PORT"),
    (":7000", "is not HOST:PORT"),
    ("host:http", "is not HOST:PORT"),
    ("host:0", "port 0 is not in 1-65535"),
    ("host:65536", "port 65536 is not in 1-65535"),
    ("300.1.2.3:80", "neither an IPv4 address nor a host name"),
    ("-bad-.example:80", "neither an IPv4 address nor a host name"),
])
def test_bad_addresses(text, message):
    with pytest.raises(AddressError, match=message.replace("[", r"\[")):
        parse_address(text)


def test_good_addresses():
    assert parse_address(" 127.0.0.1:7000 ") == Address("127.0.0.1", 7000)
    assert parse_address("node-b.cluster.local:1") == Address("node-b.cluster.local", 1)
    assert parse_address("0.0.0.0:0", allow_port_zero=True) == Address("0.0.0.0", 0)


def test_every_sglang_dtype_spelling_is_understood():
    """SGLang's own table of --dtype spellings is the reference; 'auto' is resolved by SGLang."""
    from sglang.srt.configs.model_config import _STR_DTYPE_TO_TORCH_DTYPE

    from sglang_eaas.protocol.slot import DTYPES_BY_NAME

    for spelling, dtype in _STR_DTYPE_TO_TORCH_DTYPE.items():
        assert DTYPES_BY_NAME[dtype_name(spelling)] == dtype
        assert DTYPES_BY_NAME[dtype_name(spelling.upper())] == dtype
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        dtype_name("fp8")


@pytest.mark.parametrize("spelling, expected", [
    ("auto", torch.float16),  # SGLang serves a float32 checkpoint in float16 under 'auto'
    ("half", torch.float16), ("float", torch.float32), ("bfloat16", torch.bfloat16),
])
def test_local_servers_get_the_dtype_sglang_computes_in(tiny_qwen3, spelling, expected):
    from sglang_eaas.launcher.prepare import sglang_dtype
    from sglang_eaas.protocol.slot import DTYPES_BY_NAME

    assert DTYPES_BY_NAME[sglang_dtype(str(tiny_qwen3), spelling)] == expected


def test_expert_server_takes_sglang_dtype_spellings(tiny_qwen3):
    """``--dtype half`` and ``float`` (SGLang's aliases) pass the expert server's parser; a
    spelling nobody knows is refused by it."""
    from sglang_eaas.expert_server.__main__ import parse_args

    for spelling, canonical in (("half", "float16"), ("float", "float32"), ("HALF", "float16")):
        _, config = parse_args(["--model-path", str(tiny_qwen3), "--experts", "0",
                                "--token", "t", "--dtype", spelling])
        assert dtype_name(config.dtype) == canonical
    result = subprocess.run([sys.executable, "-m", "sglang_eaas.expert_server", "--model-path",
                             str(tiny_qwen3), "--experts", "0", "--token", "t", "--dtype",
                             "fp8"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "invalid choice: 'fp8'" in result.stderr


def test_placement_files_may_place_experts_per_layer(tmp_path):
    (tmp_path / "p.yaml").write_text(
        "servers:\n  local:0: {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}\n"
        "  local:1: {'0': [7, 6, 5, 4], 1: [0, 1, 2, 3]}\n  local:2: [0]\n  local:3: {1: [3]}\n")
    placed = load_placement_file(tmp_path / "p.yaml")
    assert placed.entries == {"local:0": {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]},
                              "local:1": {0: [4, 5, 6, 7], 1: [0, 1, 2, 3]}, "local:2": [0],
                              "local:3": {1: [3]}}
    held = placed.holdings((0, 1), 8)
    assert held["local:2"] == {0: [0], 1: [0]}  # a list: in every layer
    assert held["local:3"] == {0: [], 1: [3]}  # a layer not named: none
    for layers, experts, message in [((0,), 8, "names layers [1], which are not MoE layers"),
                                     ((0, 1), 6, "lists experts [6, 7], but the model has 6")]:
        with pytest.raises(PlacementError, match=re.escape(message)):
            placed.holdings(layers, experts)
    for text, message in [("servers:\n  local:0: {x: [0]}\n", "'x' is not a layer number"),
                          ("servers:\n  local:0: {0: [1, 1]}\n",
                           "server 'local:0', layer 0 lists experts [1] more than once"),
                          ("servers:\n  local:0: {}\n", "maps to an empty map of layers")]:
        (tmp_path / "bad.yaml").write_text(text)
        with pytest.raises(PlacementError, match=re.escape(message)):
            load_placement_file(tmp_path / "bad.yaml")


def test_expert_server_takes_experts_per_layer(tiny_qwen3):
    from sglang_eaas.expert_server.__main__ import parse_args

    base = ["--model-path", str(tiny_qwen3), "--token", "t"]
    _, config = parse_args([*base, "--experts", "0-3", "--layer-experts", "1=4-7"])
    assert config.holdings((0, 1)) == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    _, config = parse_args([*base, "--layer-experts", "0=none", "--layer-experts", "1=2"])
    assert config.holdings((0, 1)) == {0: [], 1: [2]}
    for args, message in [(["--layer-experts", "7=1"], "layer 7 is not an MoE layer"),
                          (["--layer-experts", "1"], "is not LAYER=SPEC"),
                          (["--layer-experts", "0=1", "--layer-experts", "0=2"],
                           "names layer 0 twice"),
                          ([], "holds at least one expert")]:
        result = subprocess.run([sys.executable, "-m", "sglang_eaas.expert_server", *base,
                                 *args], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and message in result.stderr, result.stderr


def test_a_taken_port_is_one_sentence_and_local_servers_never_race_for_one(tiny_qwen3):
    """An expert server told to listen where another process already does says so in one
    sentence. The launcher's local servers take ports of their own choosing and report them
    (two launchers once picked the same free port and one server died: a CI failure); one
    that took a port the launcher must keep free (SGLang's, not bound yet) is started again
    elsewhere."""
    import os
    import socket

    from sglang_eaas.launcher.local_servers import start_local_servers
    from sglang_eaas.protocol.control import probe

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "sglang_eaas.expert_server",
                                 "--model-path", str(tiny_qwen3), "--experts", "0", "--token",
                                 "t", "--listen", f"127.0.0.1:{port}"],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use")
    result = subprocess.run([sys.executable, "-m", "sglang_eaas.expert_server", "--model-path",
                             str(tiny_qwen3), "--experts", "0", "--token", "t", "--ready-file",
                             "/nonexistent/ready"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.strip().endswith(
        "--ready-file: /nonexistent is not a folder"), result.stderr

    class SGLangsFirst(frozenset):  # whatever port the first server takes is SGLang's
        seen: list[int] = []

        def __contains__(self, port) -> bool:
            self.seen.append(port)
            return len(self.seen) == 1

    avoid = SGLangsFirst()
    (server,) = start_local_servers(tiny_qwen3, [[0, 1]], "float32", 1, avoid_ports=avoid,
                                    stdout=subprocess.DEVNULL)
    try:
        first, second = avoid.seen
        assert server.address == f"127.0.0.1:{second}" and second != first
        stats = probe(server.address, os.environ["SGLANG_EAAS_TOKEN"])
        assert list(stats.holdings.experts()) == [0, 1]
    finally:
        server.stop()
