"""Changing what an expert server holds while it serves (``add_experts``, ``drop_experts``).

* **Add**: the weights come from a peer server that holds them: over the weight fabric
  (``fabric.py``: mapped in place, or read one-sidedly), else chunk by chunk over its control
  endpoint (``expert_weights``; the bytes' sha256 must match); either way the peer's digest of
  each expert must equal this server's. From the checkpoint on disk if no peer is given or the
  peer fails. The layer's next version is swapped in by the serving loop between batches; only
  then does the server say it holds them (``stats``, the monitor's ``set_holdings``), so no
  client sends an expert before it can be computed.
* **Drop**: the server says at once that it no longer holds them (clients stop sending them at
  their next step), keeps answering for them while requests still come, and frees their rows
  once none came for ``grace`` seconds.
* **Parts** (``add_parts``, ``drop_parts``; tensor parallelism, docs/switching.md): the same
  for a layer's parts of experts. An added part is cut from the server's own whole rows of its
  expert, else from a holder's over the weight fabric (mapped: only the part's bytes copied),
  else read from the checkpoint; a drop takes all of a layer's parts.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

import torch

from ibgda import TransportError
from sglang_eaas.esft.adapter import AdapterError, load_adapter
from sglang_eaas.expert_server.experts import (
    LayerExperts, grown, index_of, load_parts, read_experts_into, with_experts, without_experts,
)
from sglang_eaas.expert_server.fabric import FabricReader
from sglang_eaas.slices import Part, assemble_into, cut_into
from sglang_eaas.holdings import AdapterExpert, HeldParts, ServerHoldings
from sglang_eaas.protocol.control import (
    WEIGHT_CHUNK, WEIGHT_TENSORS, AddExperts, AddParts, DropExperts, DropParts, ExpertWeights,
    HoldingsChange, PartsChange, Stats, WeightsChunk, call,
)
from sglang_eaas.protocol.lines import Channel, ControlError
from sglang_eaas.protocol.slot import DTYPE_NAMES, DTYPES_BY_NAME

if TYPE_CHECKING:
    from sglang_eaas.expert_server.server import ExpertServer

logger = logging.getLogger(__name__)
FETCH_TIMEOUT = 30.0  # seconds one chunk from a peer may take
RETIRE_POLL = 0.01  # seconds between looks at which dropped experts went quiet


class Replicas:
    """One server's holdings changes (one at a time), made on its ``HeldExperts``."""

    def __init__(self, server: "ExpertServer"):
        self.server, self.held = server, server.held
        self.fabric = FabricReader(server.held.store, server.config.weight_fabric,
                                   server.config.token, FETCH_TIMEOUT,
                                   server.fill_threads)
        self._change = threading.Lock()  # one add or drop at a time
        self._retirer: threading.Thread | None = None

    def frozen(self) -> threading.Lock:
        """Held, no holdings change is made (``with replicas.frozen(): ...``): a registration
        says what the server holds and the monitor checks it against the server, so nothing
        may change in between."""
        return self._change

    # -- add --------------------------------------------------------------------------------
    def add(self, request: AddExperts) -> HoldingsChange:
        if request.adapter:
            return self.add_adapter(request)
        if any(e >= self.server.info.num_experts for e in request.experts):
            return self.add_described(request)
        held = self.held
        layer = request.layer
        self._check_layer(layer, request.experts)
        with self._change:
            advertised = set(held.holdings.get(layer, ()))
            back = held.keep(layer, request.experts)  # still loaded: held again without a copy
            new = [e for e in request.experts if e not in advertised and e not in back]
            from_peer, from_disk = [], []
            if new:
                digests = held.digests_of(new)

                def disk(w13: torch.Tensor, w2: torch.Tensor) -> None:
                    read_experts_into(held.model_path, held.info, layer, new, w13, w2)

                if request.parts > 1:
                    made, from_peer, from_disk = self._assemble(
                        layer, new, request.parts, request.part_sources, digests)
                else:
                    made, from_peer, from_disk = self._next_version(
                        layer, new, request.source, digests, disk, held.model_path)
                held.swap_layer(layer, made)
                held.learn_digests(digests)
            held.say_held(layer, sorted(advertised | set(request.experts)))
            held.count("replicas_added", len(new) + len(back))
            logger.info("MoE layer %d: now holding experts %s too (%d from peer %s, %d from "
                        "disk, %d kept)", layer, sorted(request.experts), len(from_peer),
                        request.source or "-", len(from_disk), len(back))
            return HoldingsChange(list(held.holdings[layer]), from_peer, from_disk)

    def add_adapter(self, request: AddExperts) -> HoldingsChange:
        """Hold ESFT adapter experts: physical ids ``request.experts`` (past the model's
        experts), each replacing ``request.replaces[i]`` for the adapter's requests. Their
        weights come from the peer ``source`` if it holds the same ones, else from the
        adapter's files. A physical id this server holds for another adapter expert is
        refused; one still retiring (an unloaded adapter's) is freed first."""
        held, layer, info = self.held, request.layer, self.held.info
        self._check_layer(layer, request.experts, physical=True)
        low = [p for p in request.experts if p < info.num_experts]
        bad = [b for b in request.replaces if b >= info.num_experts]
        if low or bad:
            raise ControlError("bad_field", f"adapter experts take physical ids >= "
                               f"{info.num_experts} and replace base experts < "
                               f"{info.num_experts}, got ids {low} / base experts {bad}")
        try:
            adapter = load_adapter(request.adapter_path, info)
        except AdapterError as exc:
            raise ControlError("bad_adapter", str(exc)) from None
        unknown = [b for b in request.replaces if b not in adapter.experts.get(layer, ())]
        if unknown:
            raise ControlError("bad_adapter", f"adapter {request.adapter} does not replace "
                               f"experts {unknown} of MoE layer {layer}")
        digest = adapter.digests(info, {layer: request.replaces}).get(layer, {})
        wanted = {p: AdapterExpert(request.adapter, b, digest[b])
                  for p, b in zip(request.experts, request.replaces)}
        with self._change:
            advertised = set(held.holdings.get(layer, ()))
            have = held.holdings.adapters.get(layer, {})
            taken = [p for p in wanted if p in advertised and have.get(p) != wanted[p]]
            if taken:
                raise ControlError("adapter_slot_taken", (
                    f"expert server {self.server.address} holds other experts under physical "
                    f"ids {taken} of MoE layer {layer}"))
            new = [p for p in wanted if p not in advertised]
            stale = held.keep(layer, new)
            if stale:  # an unloaded adapter's rows, still retiring: other weights now
                held.swap_layer(layer, without_experts(held.layers[layer], stale, held.store))
            from_peer, from_disk = [], []
            if new:
                bases = [wanted[p].base for p in new]
                def disk(w13: torch.Tensor, w2: torch.Tensor) -> None:
                    loaded13, loaded2 = adapter.load_weights(info, layer, bases, held.dtype)
                    w13.copy_(loaded13)
                    w2.copy_(loaded2)

                made, from_peer, from_disk = self._next_version(
                    layer, new, request.source, {p: wanted[p].digest for p in new}, disk,
                    request.adapter_path, adapter=True)
                held.swap_layer(layer, made)
            held.adapter_from(request.adapter, request.adapter_path)
            held.say_held(layer, sorted(advertised | set(wanted)), wanted)
            held.count("adapter_experts_added", len(new))
            logger.info("MoE layer %d: now holding adapter %s's experts %s as %s (%d from peer "
                        "%s, %d from disk)", layer, request.adapter, request.replaces,
                        request.experts, len(from_peer), request.source or "-", len(from_disk))
            return HoldingsChange(list(held.holdings[layer]), from_peer, from_disk)

    def add_described(self, request: AddExperts) -> HoldingsChange:
        """Copies of adapter experts (physical ids) that the peer ``source`` holds: what they
        are (adapter, its directory, base expert) comes from the peer's ``stats``, so they can
        be replicated and moved like the model's experts, given a holder."""
        info, layer = self.held.info, request.layer
        if any(e < info.num_experts for e in request.experts) or not request.source:
            raise ControlError("bad_field", (
                f"experts {[e for e in request.experts if e >= info.num_experts]} do not exist "
                f"in the model (it has {info.num_experts}); adapter experts' physical ids are "
                "added from a peer that holds them (source), apart from the model's own"))
        try:
            stats = call(request.source, Stats(), self.server.config.token, FETCH_TIMEOUT)
        except TransportError as exc:
            raise ControlError("bad_field", f"cannot ask {request.source} what experts "
                               f"{request.experts} are: {exc}") from None
        described = stats.holdings.adapters.get(layer, {})
        unknown = [e for e in request.experts if e not in described]
        if unknown:
            raise ControlError("bad_field", f"{request.source} holds no adapter expert "
                               f"{unknown} in MoE layer {layer}")
        by_adapter: dict[str, list[int]] = {}
        for e in request.experts:
            by_adapter.setdefault(described[e].adapter, []).append(e)
        change = None
        for name, physical in by_adapter.items():
            added = self.add_adapter(AddExperts(
                layer, physical, request.source, name, stats.adapter_paths.get(name, ""),
                [described[e].base for e in physical]))
            change = added if change is None else HoldingsChange(
                added.layer_experts, change.from_peer + added.from_peer,
                change.from_disk + added.from_disk)
        return change

    def _next_version(self, layer: int, experts: list[int], source: str,
                      digests: dict[int, str],
                      from_disk: Callable[[torch.Tensor, torch.Tensor], None], disk: str,
                      adapter: bool = False) -> tuple[LayerExperts, list[int], list[int]]:
        """``layer``'s next version: what it holds, then ``experts`` (``adapter``: adapter
        experts by physical id), from the peer ``source`` (``digests``: this server's digest of
        each, the peer's must match) over the weight fabric, else over its control endpoint,
        else ``from_disk(w13, w2)``, which reads ``disk`` into the new version's rows (``w13
        [n, 2I, H]``, ``w2 [n, H, I]``). Also which experts came from the peer and which from
        disk."""
        held = self.held
        base, num_experts = held.layers.get(layer), held.info.num_experts
        if source and self.fabric.enabled:
            try:
                fill = self.fabric.fill(source, layer, base, experts, digests, num_experts,
                                        adapter)
                held.count("replicas_mapped" if fill.mapped else "replicas_read", len(experts))
                held.count("fabric_bytes_read", fill.bytes_read)
                return fill.layer, list(experts), []
            except (TransportError, ControlError, ValueError) as exc:
                held.count("fabric_fallbacks")
                logger.warning("MoE layer %d: could not read experts %s from %s over the weight "
                               "fabric (%s); asking over its control endpoint", layer, experts,
                               source, exc)
        if source:
            try:
                w13, w2 = fetch_from_peer(source, self.server.config.token, layer, experts,
                                          digests, held.dtype, adapter=adapter)
                return (with_experts(base, experts, w13, w2, num_experts, held.store),
                        list(experts), [])
            except (TransportError, ControlError, ValueError) as exc:
                held.count("replica_fetch_fallbacks")
                logger.warning("MoE layer %d: could not read experts %s from %s (%s); reading "
                               "them from %s", layer, experts, source, exc, disk)
        made, new13, new2 = grown(base, experts, num_experts, held.store)
        from_disk(new13, new2)
        return made, [], list(experts)

    # -- parts ------------------------------------------------------------------------------
    def add_parts(self, request: AddParts) -> PartsChange:
        held, layer, parts, info = self.held, request.layer, request.parts, self.held.info
        self._check_layer(layer, [])
        try:
            Part(0, parts).check(info.moe_intermediate_size)
            wanted = HeldParts(parts, tuple(sorted(request.ids)))
            ServerHoldings({}, parts={layer: wanted})  # one part of an expert at most
        except ValueError as exc:
            raise ControlError("bad_field", str(exc)) from None
        far = [i for i in request.ids if i >= info.num_experts * parts]
        if far:
            raise ControlError("bad_field", f"routed part ids {far} do not exist: the model has "
                               f"{info.num_experts} experts, so {parts}-part ids end at "
                               f"{info.num_experts * parts - 1}")
        with self._change:
            current, base = held.holdings.parts.get(layer), held.part_layers.get(layer)
            if current is None and base is not None:  # dropped, still retiring: reused
                held.keep_parts(layer)
                have = ([i for i in _routed(base) if i in set(wanted.ids)]
                        if base.parts == parts else [])
            elif base is not None:
                if base.parts != parts:
                    raise ControlError("parts_mismatch", (
                        f"expert server {self.server.address} holds {base.parts}-part slices "
                        f"of MoE layer {layer}; drop them before it holds {parts}-part ones"))
                have = sorted(_routed(base))
            else:
                have = []
            new = [i for i in wanted.ids if i not in set(have)]
            clash = sorted(set(have) & {e * parts + p for e in {j // parts for j in new}
                                        for p in range(parts)})
            if clash:
                raise ControlError("bad_field", f"MoE layer {layer}: parts {clash} of those "
                                   f"experts are held already (one part of an expert at most)")
            origin: dict[str, list[int]] = {"self": [], "peer": [], "disk": []}
            ids = have + new
            if base is None or new or len(have) != len(_routed(base)):
                w13, w2, backing = held.part_store(parts).empty(len(ids))
                if have:  # kept rows first (one copy), then the new parts cut in place
                    rows = base.local_index[torch.tensor(have, dtype=torch.long)]
                    torch.index_select(base.w13, 0, rows, out=w13[:len(have)])
                    torch.index_select(base.w2, 0, rows, out=w2[:len(have)])
                origin = self._cut_parts(layer, parts, new, request.sources,
                                         w13[len(have):], w2[len(have):])
                made = LayerExperts(w13, w2, index_of(ids, info.num_experts * parts), backing,
                                    parts)
                held.swap_layer(layer, made, parts=True)
            held.say_parts(layer, parts, sorted(ids))
            held.count("parts_added", len(new))
            logger.info("MoE layer %d: now holding %d parts of %d-part slices too (%d cut from "
                        "its own rows, %d from peers, %d from disk)", layer, len(new), parts,
                        len(origin["self"]), len(origin["peer"]), len(origin["disk"]))
            return PartsChange(parts, sorted(ids), origin["self"], origin["peer"],
                               origin["disk"])

    def _cut_parts(self, layer: int, parts: int, ids: list[int],
                   sources: dict[str, list[int]], out13: torch.Tensor, out2: torch.Tensor
                   ) -> dict[str, list[int]]:
        """The rows of the routed part ids ``ids`` into ``out13``, ``out2``, in that order (each
        part's bytes copied once); where each came from: ``self`` (cut from this server's whole
        rows), ``peer`` (a holder in ``sources``, over the weight fabric), ``disk`` (the
        checkpoint)."""
        held = self.held
        at = {i: n for n, i in enumerate(ids)}
        origin: dict[str, list[int]] = {"self": [], "peer": [], "disk": []}
        whole = held.layers.get(layer)
        mine = set(held.holdings.get(layer, ())) | set(held.retiring.get(layer, {}))
        for i in ids:
            e, n = i // parts, at[i]
            if whole is not None and e in mine and e < whole.local_index.numel():
                row = int(whole.local_index[e])
                cut_into(whole.w13[row:row + 1], whole.w2[row:row + 1], Part(i % parts, parts),
                         out13[n:n + 1], out2[n:n + 1])
                origin["self"].append(i)
        done = set(origin["self"])
        for source, experts in sources.items():
            wanted = [i for i in ids if i not in done and i // parts in set(experts)]
            if not wanted or not self.fabric.enabled:
                continue
            rows = torch.tensor([at[i] for i in wanted])
            got13, got2 = out13.new_empty(len(wanted), *out13.shape[1:]), out2.new_empty(
                len(wanted), *out2.shape[1:])
            try:
                experts_of = [i // parts for i in wanted]
                digests = held.digests_of(experts_of)
                read = self.fabric.read_parts(source, layer, experts_of, digests,
                                              [Part(i % parts, parts) for i in wanted],
                                              got13, got2)
            except (TransportError, ControlError, ValueError) as exc:
                held.count("fabric_fallbacks")
                logger.warning("MoE layer %d: could not read parts of experts %s from %s over "
                               "the weight fabric (%s); reading them from disk", layer,
                               sorted({i // parts for i in wanted}), source, exc)
                continue
            held.learn_digests(digests)
            held.count("fabric_bytes_read", read)
            out13[rows], out2[rows] = got13, got2
            origin["peer"] += wanted
            done |= set(wanted)
        rest = [i for i in ids if i not in done]
        if rest:
            loaded = load_parts(held.model_path, held.info, {layer: HeldParts(parts, rest)},
                                held.dtype)[layer]
            rows = torch.tensor([at[i] for i in rest])
            out13[rows] = loaded.w13[loaded.local_index[torch.tensor(rest)]]
            out2[rows] = loaded.w2[loaded.local_index[torch.tensor(rest)]]
            origin["disk"] = rest
        return origin

    def _assemble(self, layer: int, experts: list[int], parts: int,
                  sources: dict[str, list[int]], digests: dict[int, str]
                  ) -> tuple[LayerExperts, list[int], list[int]]:
        """``layer``'s next version: what it holds, then ``experts`` assembled from their
        ``parts`` parts (this server's own, then those the holders in ``sources`` lend over the
        weight fabric, their experts' digests checked), each part's bytes copied once into
        place; an expert a part of which none gave is read whole from disk. Also which experts
        used a peer's parts and which came from disk."""
        held = self.held
        made, new13, new2 = grown(held.layers.get(layer), experts, held.info.num_experts,
                                  held.store)
        row = {e: n for n, e in enumerate(experts)}
        got: dict[int, set[int]] = {e: set() for e in experts}
        mine = held.part_layers.get(layer)
        if mine is not None and mine.parts == parts:
            for i in _routed(mine):
                e, p = divmod(i, parts)
                if e in row:
                    r, n = int(mine.local_index[i]), row[e]
                    assemble_into(mine.w13[r:r + 1], mine.w2[r:r + 1], Part(p, parts),
                                  new13[n:n + 1], new2[n:n + 1])
                    got[e].add(p)
        shape = Part(0, parts).info(held.info)
        peer_used = set()
        for source, ids in sources.items():
            wanted = [i for i in ids if i // parts in row and i % parts not in got[i // parts]]
            if not wanted or not self.fabric.enabled:
                continue
            part13 = torch.empty(len(wanted), 2 * shape.moe_intermediate_size,
                                 shape.hidden_size, dtype=held.dtype)
            part2 = torch.empty(len(wanted), shape.hidden_size, shape.moe_intermediate_size,
                                dtype=held.dtype)
            try:
                read = self.fabric.read_part_rows(source, layer, wanted, parts, digests, part13,
                                                  part2)
            except (TransportError, ControlError, ValueError) as exc:
                held.count("fabric_fallbacks")
                logger.warning("MoE layer %d: could not read parts %s from %s over the weight "
                               "fabric (%s)", layer, wanted, source, exc)
                continue
            held.count("fabric_bytes_read", read)
            for k, i in enumerate(wanted):
                e, p = divmod(i, parts)
                if p not in got[e]:
                    n = row[e]
                    assemble_into(part13[k:k + 1], part2[k:k + 1], Part(p, parts),
                                  new13[n:n + 1], new2[n:n + 1])
                    got[e].add(p)
                    peer_used.add(e)
        rest = [e for e in experts if len(got[e]) < parts]
        if rest:
            whole13 = new13.new_empty(len(rest), *new13.shape[1:])
            whole2 = new2.new_empty(len(rest), *new2.shape[1:])
            read_experts_into(held.model_path, held.info, layer, rest, whole13, whole2)
            for k, e in enumerate(rest):
                new13[row[e]].copy_(whole13[k])
                new2[row[e]].copy_(whole2[k])
        return made, [e for e in experts if e in peer_used and e not in rest], rest

    def drop_parts(self, request: DropParts) -> PartsChange:
        s, held, layer = self.server, self.held, request.layer
        self._check_layer(layer, [])
        if s.tier is None:
            raise ControlError("drop_needs_monitor", (
                f"expert server {s.address} has no monitor, so its clients would not learn "
                "that it stops holding these parts; start it with --monitor"))
        with self._change:
            current = held.holdings.parts.get(layer)
            if current is None:
                raise ControlError("drop_not_held", f"expert server {s.address} holds no parts "
                                   f"of MoE layer {layer}")
            if not request.force:
                s.tier.check_covered(held.holdings.with_parts(layer, current.parts, []),
                                     "drop_uncovered", "drop with force")
            held.say_parts(layer, current.parts, [])
            held.retire_parts(layer, request.grace)
            self._start_retirer()
            held.count("parts_dropped", len(current.ids))
            logger.info("MoE layer %d: no longer holding its %d parts of %d-part slices (their "
                        "weights go once no request used them for %gs)", layer,
                        len(current.ids), current.parts, request.grace)
            return PartsChange(current.parts, [])

    # -- drop -------------------------------------------------------------------------------
    def drop(self, request: DropExperts) -> HoldingsChange:
        s, held = self.server, self.held
        layer = request.layer
        self._check_layer(layer, request.experts, physical=True)
        if s.tier is None:
            raise ControlError("drop_needs_monitor", (
                f"expert server {s.address} has no monitor, so its clients would not learn "
                "that it stops holding these experts; start it with --monitor"))
        with self._change:
            advertised = set(held.holdings.get(layer, ()))
            unknown = sorted(set(request.experts) - advertised)
            if unknown:
                raise ControlError("drop_not_held", (
                    f"expert server {s.address} does not hold experts {unknown} of MoE layer "
                    f"{layer} (it holds {sorted(advertised)})"))
            if not request.force:
                s.tier.check_covered(held.holdings.with_layer(
                    layer, sorted(advertised - set(request.experts))), "drop_uncovered",
                    "drop with force")
            held.say_held(layer, sorted(advertised - set(request.experts)))
            held.retire(layer, request.experts, request.grace)
            self._start_retirer()
            held.count("replicas_dropped", len(request.experts))
            logger.info("MoE layer %d: no longer holding experts %s (their weights go once no "
                        "request used them for %gs)", layer, sorted(request.experts),
                        request.grace)
            return HoldingsChange(list(held.holdings.get(layer, ())))

    def _start_retirer(self) -> None:
        """Under ``_change`` (as the retirer decides to end): one retirer while any retires."""
        if self._retirer is None:
            self._retirer = threading.Thread(target=self._retire, name="eaas-retire",
                                             daemon=True)
            self._retirer.start()

    def _retire(self) -> None:
        """Free the rows of every retiring expert (and layer of parts) that went quiet for its
        drop's grace."""
        held = self.held
        while True:
            time.sleep(RETIRE_POLL)
            with self._change:
                quiet, done = held.quiet()
                for layer, ids in quiet.items():
                    held.swap_layer(layer, without_experts(held.layers[layer], ids, held.store))
                    logger.info("MoE layer %d: freed the weights of experts %s", layer, ids)
                quiet_parts, done_parts = held.quiet_parts()
                for layer in quiet_parts:
                    held.swap_layer(layer, None, parts=True)
                    logger.info("MoE layer %d: freed the weights of its parts", layer)
                if done and done_parts:  # decided under the lock a drop starts one under
                    self._retirer = None
                    return

    def _check_layer(self, layer: int, experts: list[int], physical: bool = False) -> None:
        """``physical``: ids past the model's experts (adapter experts) may be named."""
        info = self.held.info
        if layer not in info.moe_layers:
            raise ControlError("bad_field", f"layer {layer} is not a MoE layer of this model "
                               f"(those are {list(info.moe_layers)})")
        bad = [] if physical else [e for e in experts if e >= info.num_experts]
        if bad:
            raise ControlError("bad_field", f"experts {bad} do not exist: the model has "
                               f"{info.num_experts}")


def _routed(layer: LayerExperts) -> list[int]:
    """The routed ids ``layer``'s rows are mapped under."""
    return torch.nonzero(layer.local_index >= 0).flatten().tolist()


# -- a peer's weights -----------------------------------------------------------------------
def weights_chunk(server: "ExpertServer", request: ExpertWeights) -> WeightsChunk:
    """The peer's side of ``fetch_from_peer``: one chunk of one held expert's tensor."""
    held = server.held
    layer = held.layers.get(request.layer)
    row = -1 if layer is None or request.expert >= layer.local_index.numel() else int(
        layer.local_index[request.expert])
    if row < 0 or request.expert not in held.holdings.get(request.layer, ()):
        raise ControlError("weights_not_held", f"expert server {server.address} does not hold "
                           f"expert {request.expert} of MoE layer {request.layer}")
    tensor = getattr(layer, request.tensor)[row]  # a view: this layer object stays whole
    raw = memoryview(tensor.contiguous().view(torch.uint8).reshape(-1).numpy())
    if request.offset > len(raw):
        raise ControlError("bad_field", f"offset {request.offset} is past the tensor's "
                           f"{len(raw)} bytes")
    return WeightsChunk(base64.b64encode(raw[request.offset:request.offset + WEIGHT_CHUNK])
                        .decode(), len(raw), DTYPE_NAMES[tensor.dtype], list(tensor.shape),
                        hashlib.sha256(raw).hexdigest() if request.offset == 0 else "")


def fetch_from_peer(source: str, token: str, layer: int, experts: list[int],
                    digests: dict[int, str], dtype: torch.dtype, adapter: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``experts``' ``w13``, ``w2`` of ``layer`` from the server at ``source``, as ``dtype``
    (``adapter``: ESFT adapter experts by physical id, checked against the peer's digests of
    its adapter experts).

    Raises ``TransportError``/``ControlError`` if the peer cannot give them, ``ValueError`` if
    what came is not these experts' weights (another checkpoint, or damaged in transit)."""
    channel = Channel(source, token, FETCH_TIMEOUT)
    try:
        stats = channel.call(Stats())
        theirs = ({p: d.digest for p, d in stats.holdings.adapters.get(layer, {}).items()}
                  if adapter else stats.expert_digests)
        differ = [e for e in experts if theirs.get(e) != digests[e]]
        if differ:
            raise ValueError(f"{source} holds other weights for experts {differ}")
        tensors = {name: [] for name in WEIGHT_TENSORS}
        for e in experts:
            for name in WEIGHT_TENSORS:
                tensors[name].append(_fetch_tensor(channel, layer, e, name).to(dtype))
    finally:
        channel.close()
    return torch.stack(tensors["w13"]), torch.stack(tensors["w2"])


def _fetch_tensor(channel: Channel, layer: int, expert: int, name: str) -> torch.Tensor:
    first = channel.call(ExpertWeights(layer, expert, name, 0))
    parts = [base64.b64decode(first.data)]
    got = len(parts[0])
    while got < first.total:
        chunk = channel.call(ExpertWeights(layer, expert, name, got))
        parts.append(base64.b64decode(chunk.data))
        if not parts[-1]:
            raise ValueError(f"expert {expert}'s {name} ended at {got} of {first.total} bytes")
        got += len(parts[-1])
    raw = b"".join(parts)
    if len(raw) != first.total or hashlib.sha256(raw).hexdigest() != first.sha256:
        raise ValueError(f"expert {expert}'s {name} arrived damaged ({len(raw)} bytes)")
    return torch.frombuffer(bytearray(raw), dtype=DTYPES_BY_NAME[first.dtype]).reshape(
        first.shape)
