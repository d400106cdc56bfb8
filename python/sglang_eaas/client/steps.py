"""Hook bodies around SGLang's scheduler steps: step boundaries, and requests that failed.

``Scheduler.run_batch`` is one step of a rank: the client adopts a new routing table only when
a step begins (``EaasClient.begin_step``), never in the middle of one. When the step is over,
the token rows whose experts had no live holder (``end_step``) are turned into the requests
they belong to; with attention TP every rank ends the same requests (the ranks agree by an
all-reduce over SGLang's CPU group, since a rank's table may lag another's by a step). Those
requests are finished with an error (HTTP 503 for their caller, naming the layer and experts)
and kept out of the radix cache, since their KV entries were computed without those experts;
the other requests of the batch go on.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any, Callable

import torch

from sglang_eaas.client import sglang_moe

logger = logging.getLogger(__name__)
UNNAMED = "an expert it needs has no live expert server"


def run_batch(run: Callable, scheduler: Any, batch: Any, *args, **kwargs) -> Any:
    """AROUND ``Scheduler.run_batch``."""
    client = sglang_moe.current_client()
    if client is None:
        return run(scheduler, batch, *args, **kwargs)
    client.begin_step()
    try:
        result = run(scheduler, batch, *args, **kwargs)
    finally:
        rows = client.end_step()
        if client.routing is not None:
            _route(client.routing, batch)
    failed = _agreed(_requests_of(batch, rows))
    if failed:
        _fail(client, batch, failed)
    return result


def _requests_of(batch: Any, rows: dict[int, str]) -> dict[int, str]:
    """Token rows of the step -> the indices (in ``batch.reqs``) of their requests."""
    reqs = list(getattr(batch, "reqs", None) or [])
    if not rows or not reqs:
        return {}
    mode = batch.forward_mode
    lens = list(batch.extend_lens) if mode.is_extend() else [1] * len(reqs)
    if len(lens) != len(reqs):
        logger.warning("sglang-eaas: cannot tell which requests rows %s belong to; failing the "
                       "whole batch", sorted(rows)[:8])
        return {i: next(iter(rows.values())) for i in range(len(reqs))}
    owner, failed = [], {}
    for index, n in enumerate(lens):
        owner += [index] * n
    for row, why in rows.items():
        index = owner[row] if row < len(owner) else None  # beyond: padding rows
        if index is not None:
            failed.setdefault(index, why)
    return failed


def _route(book: Any, batch: Any) -> None:
    """The step's rows to the requests that own them, for the balancer's forecast
    (``balance/forecast.py``); a decode batch holds every running request."""
    from sglang_eaas.balance.forecast import requests_of_step

    mode = batch.forward_mode
    try:
        requests = requests_of_step(getattr(batch, "reqs", None) or [], mode.is_extend(),
                                    getattr(batch, "extend_lens", None))
    except ValueError as exc:
        logger.debug("sglang-eaas: the forecast leaves this step out: %s", exc)
        requests = []
    book.end_step(requests, complete=mode.is_decode())


def _agreed(failed: dict[int, str]) -> dict[int, str]:
    """Every TP rank's failures, on every rank (``UNNAMED`` where another rank saw why)."""
    from sglang.srt.distributed import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return failed
    # The batch is the same on every rank; its size is the longest index + 1 anywhere.
    size = torch.tensor([max(failed, default=-1) + 1], dtype=torch.int64)
    torch.distributed.all_reduce(size, op=torch.distributed.ReduceOp.MAX, group=group.cpu_group)
    if size.item() == 0:
        return {}
    mask = torch.zeros(int(size.item()), dtype=torch.int64)
    mask[list(failed)] = 1
    torch.distributed.all_reduce(mask, op=torch.distributed.ReduceOp.MAX, group=group.cpu_group)
    return {i: failed.get(i, UNNAMED) for i in torch.flatnonzero(mask).tolist()}


def _fail(client: Any, batch: Any, failed: dict[int, str]) -> None:
    """End the requests of rows that could not be computed, with an error for their callers,
    and keep their KV out of the radix cache. Done on the requests themselves, right after the
    forward, as SGLang's own abort of a running request does (``to_finish``): with the overlap
    scheduler, SGLang processes this step's result on a copy of the batch, later."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    for index, why in failed.items():
        req = batch.reqs[index]
        if req.finished() or req.to_finish is not None:
            continue  # already ending (it runs one more step before it does)
        message = f"sglang-eaas: request {req.rid} cannot be served: {why}"
        logger.warning(message)
        req.to_finish = FINISH_ABORT(message, HTTPStatus.SERVICE_UNAVAILABLE,
                                     "ServiceUnavailableError")
        req.skip_radix_cache_insert = True
        client.metrics.failed_requests(1)
