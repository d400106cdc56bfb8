"""Which expert server holds which experts, and how a batch's tokens are split among them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from sglang_eaas.addresses import AddressError, parse_address
from sglang_eaas.dealing import NO_HOLDER, deal_entries
from sglang_eaas.holdings import Holdings, ServerHoldings

# What a placement file says one server holds: the same experts in every MoE layer, or per layer.
PlacedExperts = list[int] | dict[int, list[int]]


class PlacementError(ValueError):
    """A placement that cannot serve the model (an expert without a server, a bad list...)."""


def parse_expert_list(spec: str, num_experts: int | None = None) -> list[int]:
    """``"0-3,6"`` -> ``[0, 1, 2, 3, 6]``; ``"all"`` needs ``num_experts``."""
    spec = spec.strip()
    if spec == "all":
        if num_experts is None:
            raise PlacementError("'all' needs the model's number of experts")
        return list(range(num_experts))
    experts: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise PlacementError(f"{part!r} in {spec!r} is not an expert id or a range 'A-B'")
        if sep and int(hi) < int(lo):
            raise PlacementError(f"range {part!r} is empty")
        experts.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    if not experts or len(set(experts)) != len(experts):
        raise PlacementError(f"{spec!r} must list each expert once and at least one expert")
    return sorted(experts)


def even_placement(num_experts: int, num_servers: int) -> list[list[int]]:
    """Contiguous blocks, the first ``num_experts % num_servers`` servers one expert larger."""
    if not 1 <= num_servers <= num_experts:
        raise PlacementError(f"cannot spread {num_experts} experts over {num_servers} servers")
    base, extra = divmod(num_experts, num_servers)
    blocks, start = [], 0
    for s in range(num_servers):
        size = base + (s < extra)
        blocks.append(list(range(start, start + size)))
        start += size
    return blocks


@dataclass(frozen=True)
class PlacementFile:
    """A placement file as read (``load_placement_file``): each server's entry as written."""

    path: Path
    entries: Mapping[str, PlacedExperts]  # server -> a list (every MoE layer) or a layer map

    @property
    def local(self) -> bool:
        """Whether it names ``local:N`` servers (the launcher starts them), not addresses."""
        return all(name.startswith("local:") for name in self.entries)

    def holdings(self, moe_layers: Iterable[int], num_experts: int | None = None) -> Holdings:
        """Every server's experts over ``moe_layers`` (a list: the same in every layer; a layer
        a map does not name: none there). ``PlacementError`` naming the file and the entry for
        a layer that is not one of ``moe_layers`` or an expert past ``num_experts``."""
        moe_layers = tuple(moe_layers)
        out = {}
        for name, placed in self.entries.items():
            entry = f"{self.path}: server {name!r}"
            if isinstance(placed, dict):
                unknown = sorted(set(placed) - set(moe_layers))
                if unknown:
                    raise PlacementError(f"{entry} names layers {unknown}, which are not MoE "
                                         f"layers of the model (those are {list(moe_layers)})")
                held = {layer: placed.get(layer, []) for layer in moe_layers}
            else:
                held = {layer: placed for layer in moe_layers}
            far = sorted({e for ids in held.values() for e in ids
                          if num_experts is not None and e >= num_experts})
            if far:
                raise PlacementError(f"{entry} lists experts {far}, but the model has "
                                     f"{num_experts} (ids 0-{num_experts - 1})")
            out[name] = ServerHoldings(held)
        return Holdings(out)


def read_utf8(path: str | Path, error: type[Exception]) -> str:
    """The text of a file a user named (a placement or a deployment's config); ``error`` with
    one sentence naming the file when it cannot be read or is not UTF-8."""
    try:
        return Path(path).read_bytes().decode("utf-8")
    except OSError as exc:
        raise error(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text (byte {exc.start})") from None


def yaml_problem(exc: Exception) -> str:
    """Where and what a YAML syntax error is: `` at line L, column C (PROBLEM)``."""
    where = getattr(exc, "problem_mark", None)
    at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
    return f"{at} ({getattr(exc, 'problem', None) or exc})"


def load_placement_file(path: str | Path, server_names: bool = True) -> PlacementFile:
    """``{"servers": {SERVER: [expert ids] | {layer: [expert ids]}}}`` from a JSON or YAML file
    (the ``"servers"`` key may be left out: a map of servers alone): a list is held in every MoE
    layer, a map of layers per layer (a layer it does not name holds none of that server's
    experts). ``Holdings.to_message`` writes this form.

    Raises ``PlacementError`` naming the file (and the entry) for anything else: unreadable or
    non-UTF-8 bytes, a syntax error, ids that are not whole numbers >= 0 (``true`` is not 1),
    an id listed twice for one server, an empty list, a layer that is not a number. With
    ``server_names`` (the launcher's ``--eaas-placement``), servers are named ``local:N`` or
    ``HOST:PORT``, one kind per file.
    """
    import yaml

    text = read_utf8(path, PlacementError)
    try:
        data = json.loads(text)
    except ValueError as exc:
        if str(path).endswith(".json"):
            raise PlacementError(f"{path}: not valid JSON ({exc})") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise PlacementError(f"{path}: not valid JSON or YAML{yaml_problem(exc)}") from None
    servers = data.get("servers", data) if isinstance(data, dict) else None
    if not isinstance(servers, dict) or not servers:
        raise PlacementError(f"{path}: expected a 'servers' map of server -> expert ids")
    out: dict[str, PlacedExperts] = {}
    for name, experts in servers.items():
        entry = f"{path}: server {name!r}"
        if server_names:
            _check_server_name(entry, name)
        elif not isinstance(name, str):
            raise PlacementError(f"{entry}: a server is named by a string")
        if isinstance(experts, dict):  # per MoE layer
            if not experts:
                raise PlacementError(f"{entry} maps to an empty map of layers")
            layers = {}
            for layer, ids in experts.items():
                if not (type(layer) is int or (isinstance(layer, str) and layer.isdigit())):
                    raise PlacementError(f"{entry}: {layer!r} is not a layer number")
                layers[int(layer)] = _expert_ids(f"{entry}, layer {layer}", ids, empty_ok=True)
            out[name] = layers
        else:
            out[name] = _expert_ids(entry, experts, empty_ok=False)
    if server_names and 0 < sum(name.startswith("local:") for name in out) < len(out):
        raise PlacementError(f"{path}: mixes local:N servers with separately started ones; "
                             "use one kind per file")
    return PlacementFile(Path(path), out)


def _expert_ids(entry: str, experts: object, empty_ok: bool) -> list[int]:
    if not isinstance(experts, list) or not (experts or empty_ok):
        raise PlacementError(f"{entry} must map to a non-empty list of expert ids")
    bad = [e for e in experts if type(e) is not int or e < 0]
    if bad:
        raise PlacementError(f"{entry} lists {bad[0]!r}, which is not an expert id (a "
                             "whole number >= 0)")
    twice = sorted({e for e in experts if experts.count(e) > 1})
    if twice:
        raise PlacementError(f"{entry} lists experts {twice} more than once")
    return sorted(experts)


def _check_server_name(entry: str, name: object) -> None:
    if not isinstance(name, str):
        raise PlacementError(f"{entry}: a server is named 'local:N' or HOST:PORT")
    if name.startswith("local:"):
        if not name[len("local:"):].isdigit():
            raise PlacementError(f"{entry}: a local server is named 'local:N', N a number")
        return
    try:
        parse_address(name)
    except AddressError as exc:
        raise PlacementError(f"{entry}: {exc}") from None


class ExpertRouting:
    """Global expert id -> the servers holding it; assigns each (token, k) entry to one server.

    An expert on several servers (replicas) has its entries of an exchange dealt by load
    (``dealing``): the servers' entry counts for the exchange come out as even as the holdings
    allow, deterministically for the same ids. With ``allow_missing``, an expert no server
    holds (its last holder was lost) is kept in ``missing`` and its entries are assigned
    ``NO_HOLDER``; otherwise it is a ``PlacementError``.
    """

    def __init__(self, server_experts: list[list[int]], num_experts: int,
                 allow_missing: bool = False):
        holders: list[list[int]] = [[] for _ in range(num_experts)]
        for server, experts in enumerate(server_experts):
            for e in experts:
                if not 0 <= e < num_experts:
                    raise PlacementError(
                        f"server {server} holds expert {e}, but the model has {num_experts}")
                holders[e].append(server)
        self.missing = [e for e, h in enumerate(holders) if not h]
        if self.missing and not allow_missing:
            raise PlacementError(f"experts {self.missing} are on no expert server")
        self.num_servers = len(server_experts)
        width = max(1, max(len(h) for h in holders))
        self.replicas = np.array([max(1, len(h)) for h in holders], dtype=np.int64)
        self.table = np.array([(h + h[:1] * (width - len(h))) if h else [NO_HOLDER] * width
                               for h in holders], dtype=np.int64).reshape(num_experts, width)
        self.has_replicas = width > 1
        self._tensors = None  # the tables as torch tensors sharing their memory, on first use

    def assign(self, expert_ids: np.ndarray) -> np.ndarray:
        """``[T, K]`` expert ids -> ``[T, K]`` server index per entry (-1 for id -1,
        ``NO_HOLDER`` for an expert no server holds), one exchange dealt by load."""
        if not self.has_replicas:  # nothing to deal: one gather
            flat = np.asarray(expert_ids).reshape(-1)
            valid = flat >= 0
            server = np.full(flat.shape, -1, dtype=np.int64)
            server[valid] = self.table[flat[valid], 0]
            return server.reshape(np.shape(expert_ids))
        if self._tensors is None:
            import torch

            self._tensors = (torch.from_numpy(self.table), torch.from_numpy(self.replicas))
        return deal_entries(expert_ids, self.table, self.replicas, self.num_servers,
                            *self._tensors)
