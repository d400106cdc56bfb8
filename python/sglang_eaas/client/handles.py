"""The records the client's data path hands from ``dispatch`` to ``combine``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from sglang_eaas.client.connection import ServerConnection


class Sent(NamedTuple):
    """Entries sent to one server: its connection, their rows in the layer's batch (``[n]``
    int64, or a slice where they are every row of the chunk: the answer is then added in place,
    not scattered, which on a busy host spares a multi-threaded op its wait for a descheduled
    thread), and which entries of the chunk they are ``[chunk rows, K * parts]`` (bool)."""

    conn: ServerConnection
    rows: torch.Tensor | slice
    mask: np.ndarray


@dataclass
class Chunk:
    """Up to ``max_tokens`` consecutive rows from ``start``; ``pending [rows, K * parts]``: the
    entries no server has answered yet."""

    start: int
    pending: np.ndarray


@dataclass
class Dispatched:
    """The handle ``EaasClient.dispatch`` gives ``combine``: one MoE layer's rows, with the
    chunk in flight at the expert servers (host path; the device path exchanges in combine,
    so ``out`` stays None until then)."""

    layer_id: int
    hidden: torch.Tensor  # [T, H]
    topk_ids: torch.Tensor  # [T, K] global expert ids, -1 for none
    topk_weights: torch.Tensor  # [T, K]
    row_offset: int  # where these rows start in the step's batch
    micro_batch: int  # which slot per server carries them
    ids: np.ndarray | None = None  # topk_ids on the host, as routed: [T, K * parts]
    parts: int = 1  # the layer's layout when dispatched: 1 EP, P TP (RoutingTable.expand)
    epoch: int = -1  # the routing table the entries in flight were sent by
    out: torch.Tensor | None = None  # [T, H] the sum, as the answers come
    step: int = 1  # rows per chunk (the servers' max_tokens when dispatched)
    chunk: Chunk | None = None
    sent: list[Sent] = field(default_factory=list)
