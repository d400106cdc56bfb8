"""The weight fabric between two hosts (docs/elastic.md, "Weight fabric"): a holder expert
server in one network namespace, a receiver in another, joined by a veth pair: the receiver's
replicas are read one-sidedly with Mooncake's Transfer Engine across the network interface
(no mapping: the holder's memory is on another host) and equal the checkpoint's rows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from netns import OWNER_IP, PEER_IP

PEER = Path(__file__).with_name("fabric_peer.py")


def test_a_fill_across_two_hosts_reads_with_the_transfer_engine(two_hosts, tiny_qwen3, info):
    holder_host, receiver_host = two_hosts
    holder = subprocess.Popen(
        ["ip", "netns", "exec", holder_host, sys.executable, "-m", "sglang_eaas.expert_server",
         "--model-path", str(tiny_qwen3), "--experts", "all", "--listen", f"{OWNER_IP}:0",
         "--transport", "mooncake"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=os.environ.copy())
    try:
        lines = []
        for line in holder.stdout:
            lines.append(line)
            if "ready on" in line:
                break
        else:
            raise AssertionError(f"the holder did not start: {''.join(lines)[-2000:]}")
        host, port = line.split("ready on ", 1)[1].split(":")[:2]  # "HOST:PORT: experts ..."
        assert host == OWNER_IP
        address = f"{host}:{port}"
        receiver = subprocess.run(
            ["ip", "netns", "exec", receiver_host, sys.executable, str(PEER), str(tiny_qwen3),
             address, PEER_IP], capture_output=True, text=True, timeout=180)
        out = receiver.stdout.strip().splitlines()
        assert receiver.returncode == 0 and out and out[-1].startswith("ok "), (
            receiver.stdout[-2000:] + receiver.stderr[-3000:])
        row_bytes = 3 * info.moe_intermediate_size * info.hidden_size * getattr(
            torch, info.dtype).itemsize  # gate, up and down of one expert
        assert int(out[-1].split()[1]) == 3 * row_bytes  # every byte over the network
    finally:
        holder.kill()
        holder.wait()
