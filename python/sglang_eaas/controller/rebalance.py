"""A re-placement of the live tier as one operation of the tier controller: the moves of a plan
applied (``balance/apply.py``), planned again under the lease where the tier changed since the
plan, and read back. ``tools.rebalance`` and the balancer in the serving stack
(``client/balance_hooks.py``) both make their re-placements here."""

from __future__ import annotations

from typing import Callable

import numpy as np

from sglang_eaas.balance.apply import apply_placement
from sglang_eaas.balance.live import Plan, tier_holdings
from sglang_eaas.controller.bounds import check_whole_experts
from sglang_eaas.controller.controller import Ended, Held, TierController
from sglang_eaas.controller.end_state import read_end_state
from sglang_eaas.holdings import Holdings
from sglang_eaas.protocol.operations import REBALANCE, OperationRecord, tier_message


def rebalance(controller: TierController, monitor, monitor_url: str, token: str,
              decided: Plan, num_experts: int, replan: Callable[[Holdings], Plan],
              target: dict, grace: float = 2.0, wait: float = 0.0,
              say: Callable[[str], None] = lambda line: None) -> OperationRecord:
    """Apply ``decided`` as a ``rebalance`` operation (``target``: what the record shows it
    asked for). Under the lease the tier is read again; where it changed since the plan,
    ``replan(now)`` plans on it instead. The operation fails, and the record says why, when
    the tier does not hold the plan afterwards. Raises the controller's ``Busy`` while another
    operation holds the tier (after ``wait`` seconds)."""
    plan = decided

    def body(held: Held) -> Ended:
        nonlocal plan
        now, _ = tier_holdings(monitor.watch(-1, 0.0))
        check_whole_experts(now, num_experts, "the balancer")
        if now != plan.current:  # the tier changed since the plan: plan again on it
            say("rebalance: the tier changed since the plan; planning again on it")
            plan = replan(now)
        held.note(_before=tier_message(plan.current), _target=tier_message(plan.target))
        done = apply_placement(plan.current, plan.target, token, grace,
                               say=lambda line: held.progress("  " + line), fence=held.fence)
        result = (f"{sum(len(m.adds) for m in done.changes)} replicas added "
                  f"({done.from_peer} from peers, {done.from_disk} from disk), "
                  f"{sum(len(m.drops) for m in done.changes)} dropped, in {done.seconds:.1f}s")
        reached, _ = tier_holdings(monitor.watch(-1, 0.0))
        if reached.only(plan.target) != plan.target:
            raise ValueError(f"the tier does not hold the plan after it was applied ({result})")
        return Ended(result, read_end_state(monitor_url, token, None))

    return controller.run(REBALANCE, target, body, wait=wait)


def least_entries(load: np.ndarray) -> int:
    """The fewest entries any MoE layer has in ``load`` ([L, E]; 0 with no layer)."""
    return int(load.sum(axis=1).min()) if load.size else 0
