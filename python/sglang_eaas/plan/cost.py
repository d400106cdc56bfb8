"""The cost model of one step, piece by piece, on a hardware profile's roofline and links
(docs/planning.md, "Model"). Pure functions of numbers and arrays: the simulator adds them up.

* an expert with ``n`` entries on a server costs ``max(a(n) * bytes / bandwidth,
  n * flops / peak)``: its weights streamed once when it is active (``a(n) = 1 - exp(-n)``, the
  chance a Poisson count of mean ``n`` is not 0, as ``elastic/layout_cost.py`` takes it), its
  products at the peak (the sum of the two where the profile's ``roofline`` is ``sum``: a CPU
  core streams and multiplies in turn; a profile's measured ``expert_rows`` instead where it
  gives one, averaged over a Poisson count of rows); a server's time is the sum over what it
  holds, and the busiest server gates the layer; where the profile gives ``host_cores``, the
  servers of a node share them, each server's work run to its end on one core, longest first
  (``shared_cores``: list scheduling);
* a message costs the link's fixed cost plus its bytes over the link's bandwidth; an endpoint's
  bytes go one after the other, and so do its fixed costs where the profile says
  ``serial_messages`` (a CPU thread posting each message) or else once (a GPU's messages all in
  flight together); a phase (dispatch, combine) lasts as long as its busiest endpoint, plus the
  profile's ``call_s`` and ``entry_s`` per entry of a client (an endpoint's own work per phase
  outside its messages: routing, copies, sums; 0 for GPUs);
* attention on an instance of ``g`` devices costs the roofline of its weights, the KV it reads
  and its FLOPs, over ``g`` devices;
* a layer without overlap costs attention + dispatch + experts + combine; with two micro-batches
  (each half the tokens) it costs the larger of the compute of both and the communication of
  both: one's communication hides under the other's compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglang_eaas.plan.model import ModelSpec
from sglang_eaas.plan.profile import Device, HardwareProfile


def active(n: np.ndarray | float) -> np.ndarray:
    """Expected share of steps an expert with ``n`` entries on average is active."""
    return 1.0 - np.exp(-np.asarray(n, dtype=float))


def expert_costs(n: np.ndarray, model: ModelSpec, device: Device, width: float = 1.0
                 ) -> np.ndarray:
    """Seconds each expert with ``n[e]`` entries costs the server computing it, rows ``width``
    of the expert wide (1 whole, 1/P a TP part)."""
    n = np.asarray(n, dtype=float)
    if device.rows:  # measured on this device
        return device.expert_seconds_per_byte(n) * model.expert_bytes * width
    streamed = active(n) * model.expert_bytes * width / device.memory_bandwidth
    computed = n * model.expert_flops_per_entry * width / device.peak(model.info.dtype)
    return streamed + computed if device.serial else np.maximum(streamed, computed)


def shared_cores(times: np.ndarray, nodes: np.ndarray, profile: HardwareProfile
                 ) -> np.ndarray:
    """Each server's seconds until its work is done where the servers of a node share the
    profile's ``host_cores`` (None: each its own device): the node's works dealt to its cores
    longest first, each to the core free soonest, run to the end there (list scheduling).
    An operating system shares a core between processes in slices of a few milliseconds, and
    a server's work for one layer call is about as long, so it runs to its end once started:
    three equal works on two cores take two works' time, not one and a half (processor
    sharing's), and nothing ends before the node's work over its cores."""
    times = np.asarray(times, dtype=float)
    cores = profile.host_cores
    if cores is None or len(times) == 0:
        return times
    done = times.copy()
    for node in np.unique(nodes):
        free = np.zeros(cores)
        for i in sorted(np.flatnonzero(nodes == node), key=lambda i: (-times[i], i)):
            core = int(np.argmin(free))
            free[core] += times[i]
            done[i] = free[core]
    return done


def fabric_phase(entries: np.ndarray, clients: int, client_nodes: np.ndarray,
                 server_nodes: np.ndarray, entry_bytes: float, profile: HardwareProfile,
                 routed: float | None = None) -> float:
    """Seconds of one dispatch (or combine): every client sends each server ``entries[s] /
    clients`` entries of ``entry_bytes`` (one message where there is any), over the intra-
    or inter-node link; the busiest endpoint's sum. ``routed``: the (token, expert) entries
    the clients route in all (``entry_s`` each; default the entries sent, which TP's parts
    each get a copy of)."""
    entries = np.asarray(entries, dtype=float)
    sent = entries > 0
    if clients < 1 or not sent.any():
        return 0.0
    same = client_nodes[:, None] == server_nodes[None, :]  # [C, S]
    intra, inter = profile.intra_node, profile.inter_node
    nbytes = entries / clients * entry_bytes
    fixed = np.where(same, intra.message_s, inter.message_s) * sent
    moved = np.where(same, nbytes / intra.bandwidth, nbytes / inter.bandwidth) * sent
    if profile.serial_messages:  # one thread posts one message after the other
        times = fixed + moved
        busiest = max(times.sum(axis=1).max(), times.sum(axis=0).max())
    else:  # every message in flight at once: its fixed cost once, the bytes one after another
        busiest = max((fixed.max(axis=1) + moved.sum(axis=1)).max(),
                      (fixed.max(axis=0) + moved.sum(axis=0)).max())
    routed = entries.sum() if routed is None else routed
    return float(busiest + profile.call_s + profile.entry_s * routed / clients)


@dataclass(frozen=True)
class Work:
    """What one attention instance does in a step (per instance)."""

    tokens: float  # decode + prefill tokens
    context: float  # KV tokens read: the decoding sequences' contexts and the new prompts
    pairs: float  # (query, key) pairs: decode contexts plus each prompt's causal half
    requests: float  # sequences producing a token (the LM head's rows)

    def half(self) -> "Work":
        return Work(self.tokens / 2, self.context / 2, self.pairs / 2, self.requests / 2)


def attention_layer(work: Work, model: ModelSpec, device: Device, gpus: int,
                    moe: bool = True) -> float:
    """One layer's attention on an instance of ``gpus`` devices, in an MoE layer with the
    router and the shared experts, if any (``moe``). The products with the weights run at the
    weights' dtype's peak, the attention itself at the KV cache's (an FP8 checkpoint's MLA core
    is BF16)."""
    dtype = model.info.dtype
    params = model.attention_params + (
        model.info.hidden_size * model.info.num_experts + model.shared_params if moe else 0)
    nbytes = params * model.dtype_bytes + work.context * model.kv_bytes_per_token_layer
    core = model.attention_flops_per_pair * work.pairs
    if model.kv_dtype:  # the core's FLOPs in the weights' dtype's time
        core *= device.peak(dtype) / device.peak(model.kv_dtype)
    return device.roofline(nbytes, 2 * work.tokens * params + core, dtype) / gpus


def outside_moe(work: Work, model: ModelSpec, device: Device, gpus: int) -> float:
    """The rest of a step on the attention instance: the dense layers (attention and MLP) and
    the LM head."""
    info, dtype = model.info, model.info.dtype
    dense = info.num_layers - model.moe_layers
    mlp = 3 * info.hidden_size * model.dense_intermediate
    head = model.vocab_size * info.hidden_size
    t = dense * (attention_layer(work, model, device, gpus, moe=False)
                 + device.roofline(mlp * model.dtype_bytes, 2 * work.tokens * mlp, dtype) / gpus)
    return t + device.roofline(head * model.dtype_bytes, 2 * work.requests * head, dtype) / gpus


def layer_time(attention: float, dispatch: float, experts: float, combine: float) -> float:
    """One MoE layer of one batch, nothing overlapped."""
    return attention + dispatch + experts + combine


def overlapped_layer_time(attention: float, dispatch: float, experts: float, combine: float
                          ) -> float:
    """One MoE layer as two micro-batches, each of the given (half-batch) costs: the compute of
    both against the communication of both."""
    return max(2 * (attention + experts), 2 * (dispatch + combine))
