"""Published anchors: figures others measured on hardware a profile describes, against what this
model predicts for the same setup. Each is a published figure, not a measurement of this
project; the error is the model's (predicted - published) / published."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sglang_eaas.plan.cost import (Work, attention_layer, expert_costs, fabric_phase,
                                   outside_moe, overlapped_layer_time)
from sglang_eaas.plan.deployment import Deployment
from sglang_eaas.plan.load import zipf_load
from sglang_eaas.plan.model import ModelSpec
from sglang_eaas.plan.profile import HardwareProfile
from sglang_eaas.plan.records import SimSettings
from sglang_eaas.plan.sim import Simulator
from sglang_eaas.plan.traffic import Traffic

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
    out = []
    for ep, (dispatch, combine) in DEEPEP_LOW_LATENCY_US.items():
        for name, nbytes, published in (("dispatch", fp8_entry_bytes(hidden), dispatch),
                                        ("combine", hidden * 2, combine)):
            t = over_the_nic(tokens * top_k, ep, nbytes, profile)
            out.append(Anchor(f"DeepEP low-latency {name}, EP {ep}", published, t * 1e6, "us",
                              DEEPEP_SOURCE))
    return out


def fp8_entry_bytes(hidden: int) -> int:
    """One FP8 dispatch entry: the values and one float32 scale per 128 channels."""
    return hidden + hidden // 128 * 4


def over_the_nic(entries: float, ranks: int, entry_bytes: float,
                 profile: HardwareProfile) -> float:
    """One phase of DeepEP's low-latency kernels on ``ranks`` ranks, each sending and receiving
    ``entries`` entries spread over all ranks, every message over the NIC (no two ranks on one
    node): ``fabric_phase``'s busiest endpoint."""
    received = np.full(ranks, float(entries))
    senders, receivers = np.arange(ranks), np.arange(ranks) + ranks
    return fabric_phase(received, ranks, senders, receivers, entry_bytes, profile)


# DeepSeek-V3 decode on H800 with wide EP, as two sources published it. H800 SXM has the H100
# SXM's compute and memory (its NVLink is narrower, which pure-RDMA decode does not use).
DEEPSEEK_MODEL = Path(__file__).resolve().parent / "models" / "deepseek-v3"
DEEPSEEK_SOURCE = ("DeepSeek-V3/R1 Inference System Overview (github.com/deepseek-ai/"
                   "open-infra-index, 202502OpenSourceWeek, day 6): decode EP144 over 18 H800 "
                   "nodes, 2 routed + 1 shared expert per GPU, MLA and shared experts DP144, two "
                   "micro-batches; ~14.8k output tokens/s per H800 node on average over a day of "
                   "production, 20-22 tokens/s per user, 4,989 KV tokens per output token")
RTP_LLM_SOURCE = ("RTP-LLM DeepSeek replay report (github.com/alibaba/rtp-llm, docs/RTP-LLM-"
                  "DeepSeek-Replay-Tech-Report.md): the same decode layout (144 GPUs, 128 + 16 "
                  "redundant experts) on H800 over RoCE, 4K input / 2K output; 1850 output "
                  "tokens/s per GPU at 13,200 concurrent requests and 20 tokens/s per user")


@dataclass(frozen=True)
class WideEpDecode:
    """One decode step of DeepSeek's wide-EP layout on ``gpus`` devices: each device attends
    its own ``batch`` sequences (DP attention, shared experts with it) and holds ``slots``
    routed experts, the load dealt evenly (EPLB's aim); two micro-batches, each half the
    sequences, one's dispatch and combine under the other's compute (``overlapped_layer_time``);
    every message over the NIC (DeepEP's low-latency kernels), FP8 dispatch and BF16 combine."""

    gpus: int = 144
    slots: int = 2
    kv_tokens: float = 4989.0

    def step_seconds(self, model: ModelSpec, profile: HardwareProfile, batch: float) -> float:
        device, info = profile.device, model.info
        half = Work(batch / 2, batch / 2 * self.kv_tokens, batch / 2 * self.kv_tokens,
                    batch / 2)
        attention = attention_layer(half, model, device, 1)
        entries = half.tokens * info.top_k / self.slots  # each routed expert's, evenly dealt
        experts = float(expert_costs(np.full(self.slots, entries), model, device).sum())
        sent = half.tokens * info.top_k
        dispatch = over_the_nic(sent, self.gpus, fp8_entry_bytes(info.hidden_size), profile)
        combine = over_the_nic(sent, self.gpus, info.hidden_size * 2, profile)
        moe = overlapped_layer_time(attention, dispatch, experts, combine)
        full = Work(batch, batch * self.kv_tokens, batch * self.kv_tokens, batch)
        return model.moe_layers * moe + outside_moe(full, model, device, 1)

    def max_batch(self, model: ModelSpec, profile: HardwareProfile) -> int:
        """The most sequences a device's memory holds: its weights (attention side and its
        routed experts) and each sequence's ``kv_tokens`` of KV cache."""
        weights = model.attention_side_bytes + self.slots * model.moe_layers * model.expert_bytes
        per_sequence = self.kv_tokens * model.kv_bytes_per_token_layer * model.info.num_layers
        return int((profile.device.memory - weights) // per_sequence)


def wide_ep_decode(profile: HardwareProfile) -> list[Anchor]:
    """DeepSeek-V3's decode on 144 H800 in DeepSeek's layout, predicted by the cost model on
    ``profile`` (H100's: the same compute and memory): per-user speed at the published
    batch (RTP-LLM: 13,200 sequences over 144 GPUs) and output tokens/s per node at the largest
    batch per GPU whose step is within the published per-user speed (DeepSeek: 21 tokens/s,
    the middle of 20-22), the KV cache fitting. No MTP (speculative decoding), no time between
    steps, no imbalance: what the model leaves out."""
    model = ModelSpec.from_config(DEEPSEEK_MODEL)
    out = []
    rtp = WideEpDecode(kv_tokens=4096 + 2048 / 2)  # a 4K prompt's KV plus half its 2K output
    batch = 13200 / 144
    out.append(Anchor("DeepSeek-V3 decode, tokens/s per user at 13,200 sequences on 144 H800",
                      20.0, 1.0 / rtp.step_seconds(model, profile, batch), "tokens/s",
                      RTP_LLM_SOURCE))
    ds = WideEpDecode(kv_tokens=4989.0)
    tpot, fits = 1.0 / 21.0, ds.max_batch(model, profile)
    best = max((b for b in range(2, fits + 1, 2) if ds.step_seconds(model, profile, b) <= tpot),
               default=0)
    per_node = profile.gpus_per_node * best / ds.step_seconds(model, profile, best) if best else 0
    out.append(Anchor("DeepSeek-V3 decode, output tokens/s per H800 node at 21 tokens/s per "
                      "user", 14800.0, per_node, "tokens/s", DEEPSEEK_SOURCE))
    return out


EAAS_SOURCE = ("Expert-as-a-Service (EaaS) paper, section 5.6 (ablation, figure 13): DeepSeek-R1 "
               "on Hopper GPUs, 8 per node, 8 x 400 Gb/s RoCE per node; removing double "
               "batching (two micro-batches) costs 25.9% of the decode throughput at batch "
               "4096; ShareGPT, responses capped at 768 tokens (section 5.1)")
EAAS_NO_DOUBLE_BATCHING = 25.9  # % of the decode throughput lost, as published
# The KV tokens a decoding sequence reads: the paper does not give them. ShareGPT's prompts are
# a few hundred tokens and its responses (capped at 768) about as many: 300 and 1000 bracket it.
EAAS_CONTEXTS = (300, 1000)


def eaas_double_batching(profile: HardwareProfile) -> list[Anchor]:
    """EaaS's throughput lost without double batching, predicted by the simulator's own step
    (``Simulator.step_time``) on ``profile``: DeepSeek-V3's shape (R1's), 32 attention clients
    and 32 expert servers (section 5.2's 64 decode GPUs, each role on nodes of its own), 4096
    sequences decoding (128 a client), the load uniform (the paper's main runs balance
    nothing), hidden states shipped in the activations' dtype (BF16) both ways; with and
    without two micro-batches. A ratio of two steps: what the model gets wrong in both (its
    kernels at their roofline, nothing between steps) cancels in part."""
    model = ModelSpec.from_config(DEEPSEEK_MODEL)
    load = zipf_load(model.info.num_experts, model.info.moe_layers, 0.0).subset(1)
    empty = Traffic(np.zeros(0), np.zeros(0, int), np.zeros(0, int), "none")
    clients, batch = 32, 4096
    per_client = batch / clients
    sims = {overlap: Simulator(Deployment(clients, 32, overlap=overlap), model, profile, load,
                               empty, SimSettings(bucket=0.0)) for overlap in (False, True)}
    out = []
    for context in EAAS_CONTEXTS:
        work = Work(per_client, per_client * context, per_client * context, per_client)
        step = {overlap: sim.step_time(work, batch)[0] for overlap, sim in sims.items()}
        lost = 100.0 * (1.0 - step[True] / step[False])
        out.append(Anchor(f"EaaS decode without double batching, throughput lost at batch "
                          f"4096 ({context} KV tokens a sequence)", EAAS_NO_DOUBLE_BATCHING,
                          lost, "%", EAAS_SOURCE))
    return out
