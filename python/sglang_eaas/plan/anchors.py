"""Published anchors: figures others measured on hardware a profile describes, against what this
model predicts for the same setup. Each is a published figure, not a measurement of this
project; the error is the model's (predicted - published) / published."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglang_eaas.plan.cost import fabric_phase
from sglang_eaas.plan.profile import HardwareProfile

DEEPEP_SOURCE = ("DeepEP V1 low-latency kernels, docs/legacy.md of github.com/deepseek-ai/DeepEP: "
                 "H800, one CX7 400 Gb/s NIC per GPU, 128 tokens per batch, hidden 7168, "
                 "top-8, FP8 dispatch, BF16 combine, pure RDMA")
# EP size -> (dispatch, combine) microseconds, as published
DEEPEP_LOW_LATENCY_US = {32: (155.0, 273.0), 64: (173.0, 314.0), 128: (192.0, 369.0),
                         256: (194.0, 360.0)}
# EP 8 and 16 are left out: their published RDMA bandwidths (98 and 63 GB/s) exceed one CX7's
# 50 GB/s, so part of their traffic did not cross the NIC, which this model cannot say.


@dataclass(frozen=True)
class Anchor:
    name: str
    published: float
    predicted: float
    unit: str
    source: str

    @property
    def error(self) -> float:
        return (self.predicted - self.published) / self.published


def deepep_low_latency(profile: HardwareProfile) -> list[Anchor]:
    """DeepEP's low-latency dispatch and combine times at EP 32-256, predicted by the fabric
    model on ``profile``'s inter-node link (every rank sending its 128 x 8 entries to every
    rank, each over the NIC): one rank's sends or receives, the busiest endpoint."""
    hidden, tokens, top_k = 7168, 128, 8
    fp8 = hidden + hidden // 128 * 4  # FP8 values and one float32 scale per 128 channels
    bf16 = hidden * 2
    out = []
    for ep, (dispatch, combine) in DEEPEP_LOW_LATENCY_US.items():
        entries = np.full(ep, float(tokens * top_k))  # each rank receives as many as it sends
        senders, receivers = np.arange(ep), np.arange(ep) + ep  # no two on one node
        for name, nbytes, published in (("dispatch", fp8, dispatch), ("combine", bf16, combine)):
            t = fabric_phase(entries, ep, senders, receivers, nbytes, profile)
            out.append(Anchor(f"DeepEP low-latency {name}, EP {ep}", published, t * 1e6, "us",
                              DEEPEP_SOURCE))
    return out
