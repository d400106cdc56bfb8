"""What the expert servers hold: the one shape of the tier's state.

* ``ServerHoldings``: one server's experts per MoE layer (sorted, distinct ids; an ESFT adapter's
  experts by their physical ids past the model's), and which of them are adapter experts
  (``AdapterExpert``: the adapter, the base expert it replaces, its weights' digest); and, per
  MoE layer, the parts of experts it holds for tensor parallelism (``HeldParts``: the layer cut
  into ``parts`` slices, part ``p`` of expert ``e`` named by the routed id ``e * parts + p``;
  docs/switching.md), kept apart from its whole experts, so a server can hold both during a
  switch.
* ``Holdings``: the tier's, server id -> ``ServerHoldings``, in the order the servers were
  given (a routing table's server indices follow it).

Both are immutable (a change is a new record) and keyed by integer MoE layers. Strings appear
only where they cross a wire or a file: JSON object keys are strings, so ``to_message`` /
``from_message`` convert there and nowhere else. The expert server's own holdings, the
monitor's records and snapshots, the routing table, the balancer (placer, EPLB, moves), the
ESFT registrar, placement files, ``status`` and the tools all take these records.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from operator import index
from typing import Any, NamedTuple

Experts = tuple[int, ...]  # sorted, distinct expert ids


class AdapterExpert(NamedTuple):
    """What an adapter expert held under a physical id is."""

    adapter: str  # the ESFT adapter's name
    base: int  # the model's expert it replaces for the adapter's requests
    digest: str  # sha256 of its three tensors' bytes in the adapter file


class HeldParts(NamedTuple):
    """The parts of experts a server holds in one MoE layer: each expert cut into ``parts``
    slices along its intermediate dimension, part ``p`` of expert ``e`` named ``e * parts + p``
    (``ids``: sorted, distinct)."""

    parts: int
    ids: Experts

    def experts(self) -> Experts:
        """The experts with at least one part held."""
        return tuple(sorted({i // self.parts for i in self.ids}))


def _held_parts(parts: int, ids: Iterable[int]) -> HeldParts:
    if index(parts) < 2:
        raise ValueError(f"a layer of parts cuts experts into at least 2 parts, not {parts}")
    held = HeldParts(index(parts), _experts(ids))
    if len(held.experts()) != len(held.ids):
        raise ValueError(f"parts {list(held.ids)} of {parts}-part slices hold two parts of one "
                         "expert (a server holds at most one part of an expert in a layer)")
    return held


def _experts(ids: Iterable[int]) -> Experts:
    held = tuple(sorted(index(e) for e in ids))
    if len(set(held)) != len(held):
        raise ValueError(f"expert ids {list(held)} name an expert twice")
    return held


class ServerHoldings(Mapping[int, Experts]):
    """One server's experts per MoE layer (a layer it holds nothing of maps to ``()``),
    ``adapters``: MoE layer -> physical id -> ``AdapterExpert`` for the held adapter experts, and
    ``parts``: MoE layer -> ``HeldParts``, the parts of experts it holds there (layers with
    some)."""

    __slots__ = ("_layers", "adapters", "parts")

    def __init__(self, layers: Mapping[int, Iterable[int]] | None = None,
                 adapters: Mapping[int, Mapping[int, Iterable]] | None = None,
                 parts: Mapping[int, tuple[int, Iterable[int]]] | None = None):
        self._layers: dict[int, Experts] = {
            index(layer): _experts(ids) for layer, ids in sorted((layers or {}).items())}
        described = {}
        for layer, experts in (adapters or {}).items():
            held = set(self._layers.get(layer, ()))
            kept = {p: AdapterExpert(*v) for p, v in sorted(experts.items()) if p in held}
            if kept:
                described[layer] = kept
        self.adapters: Mapping[int, Mapping[int, AdapterExpert]] = described
        self.parts: Mapping[int, HeldParts] = {
            index(layer): _held_parts(*held) for layer, held in sorted((parts or {}).items())
            if held[1]}

    def __getitem__(self, layer: int) -> Experts:
        return self._layers[layer]

    def __iter__(self) -> Iterator[int]:
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)

    def __eq__(self, other: object) -> bool:
        """Equal to a ``ServerHoldings`` with the same experts and adapter records, or to a
        plain mapping of the same experts per layer (any sequence type)."""
        if isinstance(other, ServerHoldings):
            return (self._layers == other._layers and self.adapters == other.adapters
                    and self.parts == other.parts)
        if not isinstance(other, Mapping):
            return NotImplemented
        try:
            return self._layers == {layer: tuple(ids) for layer, ids in other.items()}
        except TypeError:
            return False

    def __hash__(self) -> int:
        return hash(tuple(self._layers.items()))

    def __repr__(self) -> str:
        adapters = f", adapters={dict(self.adapters)}" if self.adapters else ""
        parts = f", parts={dict(self.parts)}" if self.parts else ""
        return f"ServerHoldings({self._layers}{adapters}{parts})"

    def __str__(self) -> str:
        """``{layer: [experts]}``, as logs and messages show it (and the parts held)."""
        whole = str({layer: list(ids) for layer, ids in self._layers.items()})
        if not self.parts:
            return whole
        return whole + " parts " + str({layer: f"{len(held.ids)} of {held.parts}-part slices"
                                        for layer, held in self.parts.items()})

    def same_experts(self, other: Mapping[int, Iterable[int]]) -> bool:
        """Whether ``other`` holds the same experts per layer (adapter records aside)."""
        return self._layers == {layer: tuple(sorted(ids)) for layer, ids in other.items()}

    def holds_any(self) -> bool:
        """Whether it holds anything: an expert, or a part of one, in some layer (a standby
        server holds nothing)."""
        return any(self._layers.values()) or bool(self.parts)

    def experts(self) -> Experts:
        """Every expert held in at least one layer."""
        return tuple(sorted({e for ids in self._layers.values() for e in ids}))

    def with_layer(self, layer: int, experts: Iterable[int],
                   adapters: Mapping[int, AdapterExpert] | None = None) -> "ServerHoldings":
        """``layer`` holding ``experts`` instead; ``adapters`` describes adapter experts among
        them, added to those already described (a dropped one's record goes with it)."""
        described = {**self.adapters, layer: {**self.adapters.get(layer, {}), **(adapters or {})}}
        return ServerHoldings({**self._layers, layer: experts}, described, self.parts)

    def with_parts(self, layer: int, parts: int, ids: Iterable[int]) -> "ServerHoldings":
        """``layer`` holding the parts ``ids`` of ``parts``-part slices instead of the parts it
        held there (no ids: none)."""
        return ServerHoldings(self._layers, self.adapters, {**self.parts, layer: (parts, ids)})

    def model_experts(self, num_experts: int) -> "ServerHoldings":
        """Without the ESFT adapter experts (physical ids ``>= num_experts``); parts held are
        kept (they are the model's experts')."""
        return ServerHoldings({layer: [e for e in ids if e < num_experts]
                               for layer, ids in self._layers.items()}, None, self.parts)

    def below(self, size: int) -> "ServerHoldings":
        """Only the expert ids under ``size`` (and their adapter records)."""
        return ServerHoldings({layer: [e for e in ids if e < size]
                               for layer, ids in self._layers.items()}, self.adapters, self.parts)

    # -- the wire and files: string keys -------------------------------------------------
    def layers_message(self) -> dict[str, list[int]]:
        """``{str(layer): [ids]}`` (``Member.layer_experts``'s form on the wire)."""
        return {str(layer): list(ids) for layer, ids in self._layers.items()}

    def adapters_message(self) -> dict[str, dict[str, list]]:
        """``{str(layer): {str(physical id): [adapter, base expert, digest]}}``."""
        return {str(layer): {str(p): list(v) for p, v in experts.items()}
                for layer, experts in self.adapters.items()}

    def parts_message(self) -> dict[str, list]:
        """``{str(layer): [parts, [routed ids]]}``."""
        return {str(layer): [held.parts, list(held.ids)] for layer, held in self.parts.items()}

    @classmethod
    def from_message(cls, layers: Mapping[str, Iterable[int]],
                     adapters: Mapping[str, Mapping[str, Iterable]] | None = None,
                     parts: Mapping[str, list] | None = None) -> "ServerHoldings":
        """From ``layers_message()``, ``adapters_message()`` and ``parts_message()`` (shapes
        checked by the receiver: ``protocol/lines.py``'s ``read_holdings``)."""
        return cls({int(layer): ids for layer, ids in layers.items()},
                   {int(layer): {int(p): v for p, v in experts.items()}
                    for layer, experts in (adapters or {}).items()},
                   {int(layer): (held[0], held[1]) for layer, held in (parts or {}).items()})


class Holdings(Mapping[str, ServerHoldings]):
    """The tier's holdings: server id -> ``ServerHoldings``, in the order given."""

    __slots__ = ("_servers",)

    def __init__(self, servers: Mapping[str, Mapping[int, Iterable[int]]] | None = None):
        self._servers: dict[str, ServerHoldings] = {
            s: held if isinstance(held, ServerHoldings) else ServerHoldings(held)
            for s, held in (servers or {}).items()}

    @classmethod
    def uniform(cls, experts: Mapping[str, Iterable[int]], layers: Iterable[int]) -> "Holdings":
        """Every server holds the same experts in every layer of ``layers``."""
        layers = tuple(layers)
        return cls({s: {layer: ids for layer in layers}
                    for s, ids in ((s, tuple(ids)) for s, ids in experts.items())})

    def __getitem__(self, server: str) -> ServerHoldings:
        return self._servers[server]

    def __iter__(self) -> Iterator[str]:
        return iter(self._servers)

    def __len__(self) -> int:
        return len(self._servers)

    def __eq__(self, other: object) -> bool:
        """As mappings: the same servers (in any order), each holding the same."""
        if not isinstance(other, Mapping):
            return NotImplemented
        return set(self._servers) == set(other) and all(
            self._servers[s] == other[s] for s in self._servers)

    def __hash__(self) -> int:
        return hash(frozenset(self._servers.items()))

    def __repr__(self) -> str:
        return f"Holdings({self._servers})"

    @property
    def servers(self) -> tuple[str, ...]:
        return tuple(self._servers)

    def layers(self) -> tuple[int, ...]:
        """Every MoE layer some server says something about, sorted."""
        return tuple(sorted({layer for held in self._servers.values() for layer in held}))

    def layer(self, layer: int) -> dict[str, Experts]:
        """One MoE layer: server -> its experts there (``()`` where it holds none)."""
        return {s: held.get(layer, ()) for s, held in self._servers.items()}

    def holders(self, layer: int) -> dict[int, list[str]]:
        """One MoE layer: expert -> the servers holding it, in server order."""
        out: dict[int, list[str]] = {}
        for s, held in self._servers.items():
            for e in held.get(layer, ()):
                out.setdefault(e, []).append(s)
        return out

    @property
    def adapters(self) -> dict[str, Mapping[int, Mapping[int, AdapterExpert]]]:
        """server -> MoE layer -> physical id -> ``AdapterExpert``, servers with any."""
        return {s: held.adapters for s, held in self._servers.items() if held.adapters}

    def with_server(self, server: str, held: Mapping[int, Iterable[int]]) -> "Holdings":
        """``server`` holding ``held`` (replacing what it held, or added last). A plain
        mapping keeps what the server said of the adapter experts it still holds."""
        if not isinstance(held, ServerHoldings) and server in self._servers:
            old = self._servers[server]
            held = ServerHoldings(held, old.adapters, old.parts)
        return Holdings({**self._servers, server: held})

    def without(self, server: str) -> "Holdings":
        return Holdings({s: h for s, h in self._servers.items() if s != server})

    def only(self, servers: Iterable[str]) -> "Holdings":
        """The servers of ``servers`` that this names, in this order."""
        keep = set(servers)
        return Holdings({s: h for s, h in self._servers.items() if s in keep})

    def model_experts(self, num_experts: int) -> "Holdings":
        """Without the ESFT adapter experts (the balancer places only the model's)."""
        return Holdings({s: h.model_experts(num_experts) for s, h in self._servers.items()})

    def digest(self) -> str:
        """A short digest of what every server holds (experts, adapter records and parts),
        whatever the servers' order: operation records keep it as the tier's end state."""
        body = json.dumps({s: [h.layers_message(), h.adapters_message(), h.parts_message()]
                           for s, h in self._servers.items()}, sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    # -- files: string keys --------------------------------------------------------------
    def to_message(self) -> dict[str, Any]:
        """``{"servers": {server: {str(layer): [ids]}}}``: a placement file's form
        (``placement.load_placement_file`` reads it back)."""
        return {"servers": {s: held.layers_message() for s, held in self._servers.items()}}
