"""``python -m sglang_eaas.tools.expert_load``: PNG heatmaps from a load dump (and placements),
one summary line per layer, and one clear sentence (exit status 2) for bad input."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sglang_eaas.balance.evaluate import layer_load
from sglang_eaas.balance.load import LoadWindow, append_dump
from sglang_eaas.placement import load_placement_file
from sglang_eaas.routing_table import RoutingTable
from sglang_eaas.tools.expert_load import main

LAYERS = [1, 3, 5]
EXPERTS = 16


def counts(seed: int) -> np.ndarray:
    """``[3, 16]`` skewed token counts: a few hot experts per layer."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, EXPERTS + 1) ** 1.2
    return np.stack([rng.multinomial(4000, weights[rng.permutation(EXPERTS)] / weights.sum())
                     for _ in LAYERS])


@pytest.fixture
def dump(tmp_path) -> Path:
    path = tmp_path / "load.jsonl"
    append_dump(path, [LoadWindow.of("client-0", 0, 8, 10.0, 11.0, LAYERS, counts(0)),
                       LoadWindow.of("client-0", 8, 8, 11.0, 12.0, LAYERS, counts(1))])
    return path


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR, after checking the signature; decodes it fully."""
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    assert matplotlib.image.imread(path).shape[:2] == (height, width)
    return width, height


def test_balance_writes_both_heatmaps_and_one_line_per_layer(dump, tmp_path, capsys):
    out, saved = tmp_path / "png", tmp_path / "after.json"
    assert main([str(dump), "--out", str(out), "--balance", "--servers", "4",
                 "--save-after", str(saved)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[:2] == [f"wrote {out / 'load.png'}", f"wrote {out / 'placement.png'}"]
    for name in ("load.png", "placement.png"):
        width, height = png_size(out / name)
        assert width >= 400 and height >= 150
    # the one placement format: what --eaas-placement reads
    after = load_placement_file(saved, server_names=False).holdings(LAYERS, EXPERTS)
    RoutingTable.build(0, after, LAYERS, EXPERTS)  # every expert of every layer held
    loads = (counts(0) + counts(1)).astype(float)
    lines = printed[2:]
    assert len(lines) == 3
    for row, (layer, line) in enumerate(zip(LAYERS, lines)):
        ratio = layer_load(after.layer(layer), loads[row]).max_over_mean
        assert line.startswith(f"layer {layer}: expert max/mean ")
        assert f"servers max/mean after {ratio:.3f}" in line and "before" in line
        assert ratio <= 1.1


def test_load_only_and_given_placements(dump, tmp_path, capsys):
    assert main([str(dump), "--out", str(tmp_path / "a")]) == 0
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["load.png"]
    assert "servers" not in capsys.readouterr().out
    before = tmp_path / "before.json"  # the list form: the same experts in every layer
    before.write_text(json.dumps({"servers": {"x": list(range(8)), "y": list(range(8, 16))}}))
    after = tmp_path / "after.json"
    after.write_text(json.dumps({"x": {str(layer): list(range(16)) for layer in LAYERS},
                                 "y": {str(layer): list(range(16)) for layer in LAYERS}}))
    assert main([str(dump), "--out", str(tmp_path / "b"), "--placement", str(before),
                 "--after", str(after)]) == 0
    png_size(tmp_path / "b" / "placement.png")
    lines = capsys.readouterr().out.splitlines()[2:]
    assert all("after 1.000 (32 replicas)" in line for line in lines)  # both hold everything


@pytest.mark.parametrize("make,flags,message", [
    (None, [], "load dump {dir}/missing.jsonl: no such file"),
    ("garbage.jsonl", [], "{dir}/garbage.jsonl:3: not a load window"),
    ("far.json", ["--placement"], "server 'x' lists experts [16], but the model has 16"),
    ("short.json", ["--placement"], "MoE layer 1: experts [15] are on no expert server"),
    ("layer.json", ["--placement"], "server 'x' names layers [2], which are not MoE layers"),
    ("broken.json", ["--after"], "not valid JSON"),
    (None, ["--balance", "--slots", "0"], "--slots must be >= 1"),
    (None, ["--balance", "--servers", "0"], "--servers must be >= 1"),
    (None, ["--balance", "--servers", "17"], "--servers 17 is more than the 16 experts"),
    (None, ["--balance", "--servers", "4", "--slots", "3"], "--slots 3 on 4 servers cannot"),
    (None, ["--servers", "4"], "--servers, --slots and --save-after go with --balance"),
    (None, ["--balance", "--cv-target", "nan"], "--cv-target must be a number >= 0"),
    (None, ["--balance", "--warm-slack", "-1"], "--warm-slack must be a number >= 0"),
    (None, ["--balance", "--servers", "four"], "argument --servers: invalid int value"),
    (None, ["--balance", "--after", "x.json"], "not allowed with argument"),
    (None, ["--source", "nobody"], "no load windows of source 'nobody'"),
])
def test_bad_input_is_one_sentence_and_status_2(dump, tmp_path, capsys, make, flags, message):
    files = {
        "garbage.jsonl": dump.read_text() + "{not json\n",
        "far.json": json.dumps({"x": {"1": [0, 16]}}),
        "short.json": json.dumps({"x": list(range(15))}),
        "layer.json": json.dumps({"x": {"2": [0]}}),
        "broken.json": "{",
    }
    argv = [str(dump)]
    if make and make.endswith(".jsonl"):
        (tmp_path / make).write_text(files[make])
        argv = [str(tmp_path / make)]
    elif make:
        (tmp_path / make).write_text(files[make])
        flags = flags + [str(tmp_path / make)]
    if "no such file" in message:
        argv = [str(tmp_path / "missing.jsonl")]
    with pytest.raises(SystemExit) as exit_:
        main(argv + flags + ["--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message.format(dir=tmp_path) in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # nothing drawn


def test_command_line_help_and_errors_without_traceback(tmp_path):
    run = [sys.executable, "-m", "sglang_eaas.tools.expert_load"]
    shown = subprocess.run(run + ["--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0
    for flag in ("--out", "--source", "--placement", "--after", "--balance", "--servers",
                 "--slots", "--cv-target", "--warm-slack", "--save-after"):
        assert flag in shown.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"source": "c", "first_step": 0}\n')
    failed = subprocess.run(run + [str(bad)], capture_output=True, text=True, timeout=60)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr
    assert f"{bad}:1: not a load window" in failed.stderr
