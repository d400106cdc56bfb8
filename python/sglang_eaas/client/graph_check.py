"""Hook body: the host checks the device exchange after each CUDA graph replay.

Inside a captured graph ``DeviceStep.forward`` cannot read its status (``client/device_step.py``):
a failed exchange adds no rows and stays sticky in the status until the host checks. In SGLang
0.5.23 a decode step replays its graph in ``DecodeCudaGraphRunner.execute`` (load the batch into
the graph's buffers, ``backend.replay``, slice the output), which ``ModelRunner._forward_raw``
calls instead of the eager path, so the check wraps that call: replay, then check every
``DeviceStep`` of this process. On a failure the same batch is run once more the way
``_forward_raw`` runs a batch that no graph takes (``_prepare_eager_forward_batch``, then
``eager_runner.execute``), where each layer checks its own exchange at once: that output replaces
the replay's ("redone"), and if it fails too its ``TransportError`` propagates (the request
fails).

Redoing is sound because a decode forward is a function of its inputs and of the KV cache at
other positions: the re-run rewrites this step's KV entries (the same slots) with the right
values. It is not redone, and the failure propagates, where that does not hold or could not be
done alone: another rank shares the forward (it would not join the re-run's collectives), the
model keeps recurrent state that the replay already advanced, or the batch's attention metadata
was planned ahead for the graph (speculative decoding).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ibgda import TransportError
from sglang_eaas.client.device_step import check_every_step

logger = logging.getLogger(__name__)


def check_after_replay(execute: Callable, runner: Any, forward_batch: Any, *args,
                       **kwargs) -> Any:
    """AROUND ``DecodeCudaGraphRunner.execute``: replay, check every device exchange, and redo
    a failed batch once without the graph."""
    output = execute(runner, forward_batch, *args, **kwargs)
    try:
        check_every_step()
    except TransportError as failure:
        model_runner = runner.model_runner
        unsafe = why_not_redone(model_runner, forward_batch)
        if unsafe is not None:
            raise TransportError(f"{failure}; the batch is not redone: {unsafe}") from None
        logger.warning("sglang-eaas: %s; running this batch again without the CUDA graph",
                       failure)
        return run_eagerly(model_runner, forward_batch, *args, **kwargs)
    return output


def run_eagerly(model_runner: Any, forward_batch: Any, pp_proxy_tensors: Any = None) -> Any:
    """``ModelRunner._forward_raw``'s path for a batch no graph takes, on a single rank."""
    model_runner._prepare_eager_forward_batch(forward_batch)
    return model_runner.eager_runner.execute(forward_batch, pp_proxy_tensors=pp_proxy_tensors)


def why_not_redone(model_runner: Any, forward_batch: Any) -> str | None:
    """Why the batch cannot be run again alone and eagerly, or None if it can."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return (f"{dist.get_world_size()} ranks share this forward and the others would not "
                "join the re-run")
    pool = getattr(model_runner, "req_to_token_pool", None)
    if pool is not None:
        from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

        if isinstance(pool, HybridReqToTokenPool):
            return "the replay already advanced the model's recurrent state"
    if not forward_batch.needs_forward_metadata_init():
        return "its attention metadata was planned ahead for the graph"
    return None
