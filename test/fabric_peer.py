"""Run inside a network namespace by test_fabric_netns: an expert server holding expert 0 of
every MoE layer fills experts 3, 5 and 6 of the first from a holder on another host over the
weight fabric (Mooncake's Transfer Engine), checks each row against the checkpoint as
safetensors reads it, and prints ``ok BYTES`` (the bytes read one-sidedly).

    python fabric_peer.py MODEL HOLDER_ADDRESS THIS_HOST_IP
"""

from __future__ import annotations

import os
import sys

import torch
from safetensors import safe_open

from sglang_eaas.checkpoint import tensor_files
from sglang_eaas.expert_server.server import ExpertServer, ExpertServerConfig
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.protocol.control import AddExperts, call, probe

EXPERTS = [3, 5, 6]


def main() -> int:
    model, holder, host = sys.argv[1:4]
    token = os.environ["SGLANG_EAAS_TOKEN"]
    info = MoeModelInfo.from_model_path(model)
    first = info.moe_layers[0]
    server = ExpertServer(ExpertServerConfig(
        model, (0,), host=host, token=token, transport="mooncake", spare_experts=4,
        weight_fabric="map"))
    server.start()
    try:
        reply = call(server.address, AddExperts(first, EXPERTS, holder), token, 120)
        counters = probe(server.address, token).counters
        if reply.from_peer != EXPERTS or counters.get("fabric_fallbacks", 0):
            print(f"not over the fabric: {reply}, {counters}", flush=True)
            return 1
        layer, files = server.held.layers[first], tensor_files(model)
        for e in EXPERTS:
            gate, up, down = (safe_open(files[n], "pt").get_tensor(n).to(layer.w13.dtype)
                              for n in info.expert_tensor_names(first, e))
            row = int(layer.local_index[e])
            if not (torch.equal(layer.w13[row], torch.cat([gate, up]))
                    and torch.equal(layer.w2[row], down)):
                print(f"expert {e}'s rows differ from the checkpoint's", flush=True)
                return 1
        print(f"ok {counters['fabric_bytes_read']}", flush=True)
        return 0
    finally:
        server.close()


if __name__ == "__main__":
    sys.exit(main())
