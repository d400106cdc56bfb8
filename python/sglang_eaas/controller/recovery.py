"""Finishing or rolling back an operation whose driver died holding the lease (its lease lapsed
before it ended): the next operation to take the lease does it first (``Held.recover_lapsed``).

The record's target says what was asked and, from the moment the driver began changing the
tier, what it planned (``_before``, ``_target``, ``_placed``, ``_from``: recorded before the
first change); the holdings, read from the monitor, say what was done. Per kind:

* resize, retire: resized again to the target (the placement settled over the active
  servers); where that cannot be done (no standby server, no launcher here), the tier is
  placed back over the servers active before and the others emptied (rolled back);
* switch: every layer switched to the target layout (one cut short is completed, leftovers of
  the other layout dropped); where that cannot be, back to the layout it had;
* rebalance: the planned placement applied, where its servers all still serve; else the one
  before (rolled back);
* ESFT adapter load: done where every expert it placed is held, else its experts dropped
  (rolled back); an unload: its remaining experts dropped;
* restart (deploy): done where the server is back, else failed.

An operation whose driver died before it changed anything (nothing planned recorded) failed.
Every change carries the recovering operation's fence.
"""

from __future__ import annotations

from typing import Callable

from ibgda import TransportError
from sglang_eaas.balance.apply import apply_placement
from sglang_eaas.controller.end_state import read_end_state
from sglang_eaas.elastic.resize import Resizer, ResizeError
from sglang_eaas.elastic.switch import EP, TP, Switcher, SwitchError
from sglang_eaas.holdings import Holdings
from sglang_eaas.membership import current_snapshot
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.protocol.control import DropExperts, call
from sglang_eaas.protocol.lines import ControlError
from sglang_eaas.protocol.operations import (
    ADAPTER_LOAD, ADAPTER_UNLOAD, DONE, FAILED, REBALANCE, RESIZE, RESTART, RETIRE,
    ROLLED_BACK, SWITCH, Fence, OperationRecord, read_tier,
)

Say = Callable[[str], None]
NOT_BEGUN = "its driver died before it changed anything"


def recover(record: OperationRecord, monitor: str, token: str, fence: Fence,
            say: Say) -> tuple[str, str, dict]:
    """``(state, result, end state)`` of ``record`` once finished or rolled back."""
    handler = {RESIZE: _resize, RETIRE: _resize, SWITCH: _switch, REBALANCE: _rebalance,
               ADAPTER_LOAD: _adapter_load, ADAPTER_UNLOAD: _adapter_unload,
               RESTART: _restart}[record.kind]
    state, result = handler(record.target, monitor, token, fence, say)
    return state, result, read_end_state(monitor, token, record.target.get("fingerprint"))


def _resize(target: dict, monitor: str, token: str, fence: Fence, say: Say) -> tuple[str, str]:
    if "_before" not in target:
        return FAILED, NOT_BEGUN
    resizer = Resizer(monitor, token, target["num_experts"], None, target.get("fingerprint"),
                      say=say)
    active, standby = current_snapshot(monitor, token).active_and_standby(target.get("fingerprint"))
    retire = [s for s in target.get("retire", ()) if s in active or s in standby]
    try:
        done = resizer.resize(target["servers"], retire, fence, settle=True)
        return DONE, f"finished: {done.summary()}"
    except (ResizeError, TransportError, ControlError) as exc:
        say(f"recovery: the resize cannot be finished here ({exc}); rolling it back")
    done = resizer.restore(target["_before"], fence)
    return ROLLED_BACK, f"rolled back: {done.summary()}"


def _switch(target: dict, monitor: str, token: str, fence: Fence, say: Say) -> tuple[str, str]:
    if "_from" not in target:
        return FAILED, NOT_BEGUN
    model = dict(target["model"])
    info = MoeModelInfo(**{**model, "moe_layers": tuple(model["moe_layers"])})
    switcher = Switcher(monitor, token, info, target.get("grace", 0.05), say=say)
    serving = set(switcher.holdings())
    group = [s for s in target.get("group") or () if s in serving] or None
    layers = list(target["layers"])
    try:
        switcher.switch(layers, target["to"], group, target.get("parts") or None, fence)
        return DONE, f"finished: MoE layers {layers} are {target['to'].upper()}"
    except (SwitchError, TransportError, ControlError) as exc:
        say(f"recovery: the switch cannot be finished here ({exc}); rolling it back")
    back: dict[int, list[int]] = {}  # parts before -> the layers that had them
    for layer in layers:
        back.setdefault(int(target["_from"].get(str(layer), 1)), []).append(layer)
    for parts, them in back.items():
        switcher.switch(them, EP if parts == 1 else TP, group, None if parts == 1 else parts,
                        fence)
    return ROLLED_BACK, f"rolled back: MoE layers {layers} are back in their layouts {back}"


def _model_holdings(monitor: str, token: str, target: dict) -> Holdings:
    return current_snapshot(monitor, token).holdings(target.get("fingerprint")).model_experts(
        target["num_experts"])


def _rebalance(target: dict, monitor: str, token: str, fence: Fence,
               say: Say) -> tuple[str, str]:
    if "_target" not in target:
        return FAILED, NOT_BEGUN
    current = _model_holdings(monitor, token, target)
    planned = read_tier(target["_target"])
    if set(planned) <= set(current):
        done = apply_placement(current, planned, token, target.get("grace", 2.0), say=say,
                               fence=fence)
        return DONE, f"finished: {len(done.changes)} changes made"
    before = read_tier(target["_before"])
    gone = sorted(set(planned) - set(current))
    done = apply_placement(current, before.only(current), token, target.get("grace", 2.0),
                           say=say, fence=fence)
    return ROLLED_BACK, (f"rolled back ({len(done.changes)} changes): servers {gone} of its "
                         "placement no longer serve")


def _held_of(placed: Holdings, current: Holdings) -> dict[str, dict[int, list[int]]]:
    """The experts of ``placed`` that their servers still hold."""
    return {s: {layer: [e for e in ids if e in current[s].get(layer, ())]
                for layer, ids in held.items()} for s, held in placed.items() if s in current}


def _drop(held: dict[str, dict[int, list[int]]], token: str, fence: Fence) -> int:
    dropped = 0
    for server, layers in held.items():
        for layer, ids in layers.items():
            if ids:
                call(server, DropExperts(layer, ids, force=True, grace=0.0, epoch=fence.epoch),
                     token, 30.0)
                dropped += len(ids)
    return dropped


def _adapter_load(target: dict, monitor: str, token: str, fence: Fence,
                  say: Say) -> tuple[str, str]:
    if "_placed" not in target:
        return FAILED, NOT_BEGUN
    placed = read_tier(target["_placed"])
    held = _held_of(placed, current_snapshot(monitor, token).holdings())
    wanted = sum(len(ids) for s in placed.values() for ids in s.values())
    if sum(len(ids) for s in held.values() for ids in s.values()) == wanted and wanted:
        return DONE, (f"finished: ESFT adapter {target['adapter']}'s {wanted} experts are all "
                      "placed (its SGLang instance publishes it when it loads it again)")
    dropped = _drop(held, token, fence)
    return ROLLED_BACK, (f"rolled back: {dropped} of ESFT adapter {target['adapter']}'s experts "
                         "dropped (its placement was cut short)")


def _adapter_unload(target: dict, monitor: str, token: str, fence: Fence,
                    say: Say) -> tuple[str, str]:
    placed = read_tier(target.get("_placed", {}))
    dropped = _drop(_held_of(placed, current_snapshot(monitor, token).holdings()), token, fence)
    return DONE, f"finished: {dropped} more of ESFT adapter {target['adapter']}'s experts dropped"


def _restart(target: dict, monitor: str, token: str, fence: Fence,
             say: Say) -> tuple[str, str]:
    serving = current_snapshot(monitor, token).holdings()
    if target["server"] in serving:
        return DONE, f"finished: expert server {target['server']} is back"
    return FAILED, f"expert server {target['server']} did not come back"
