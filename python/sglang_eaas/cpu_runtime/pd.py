"""SGLang's PD disaggregation on a CPU: prefill and decode instances with KV over Mooncake (TCP).

Stock SGLang 0.5.23 serves ``--disaggregation-mode prefill|decode`` with
``--disaggregation-transfer-backend mooncake_tcp`` on a CPU except for three GPU-only steps,
each an optimisation with a plain path beside it. Where the CPU runtime is active these hooks
take the plain path (docs/cpu-runtime.md, docs/deployment.md):

* decode: the retraction backup defaults to ``host_pool``, a second KV pool registered with
  CUDA (``cudaHostRegister``); on a CPU the KV already lives in host memory, so the default here
  is ``cpu_tensor`` (``server_defaults.apply``); an explicit ``host_pool`` is refused.
* prefill: ``MooncakeKVSender.supports_host_tensor_indices`` copies each chunk's page indices
  into pinned memory and records a ``torch.cuda.Event`` for the transfer thread to wait on;
  here the indices are computed in place (SGLang's path for senders without it).
* prefill: the early send of a cached prefix records a ``torch.cuda.Event`` under overlap
  scheduling; here the prefix goes with the request's regular send (SGLang's own fallback when
  an early send does not apply).
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_eaas import cpu_runtime
from sglang_eaas.refusal import Refusal

PLAIN_RETRACTION_BACKUPS = ("cpu_tensor", "none")


def _on_cpu(device: str | None = "cpu") -> bool:
    return cpu_runtime.is_active() and device == "cpu"


def retraction_backup(cfg: Any) -> str | None:
    """The decode retraction backup the CPU runtime resolves for ``cfg`` (None: leave it);
    ``Refusal`` (one sentence, no traceback) for one that needs CUDA."""
    if not _on_cpu(cfg.device) or cfg.disaggregation_mode != "decode":
        return None
    given = cfg.disaggregation_decode_retraction_backup
    if given is None:
        return "cpu_tensor"
    if given not in PLAIN_RETRACTION_BACKUPS:
        raise Refusal(
            f"--disaggregation-decode-retraction-backup {given} registers a host KV pool with "
            "CUDA and cannot run without a GPU; use cpu_tensor (the CPU default) or none")
    return None


def plain_kv_indices(_result: Any, sender: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``MooncakeKVSender.__init__``: send page indices computed in place, not through
    pinned memory and a CUDA event."""
    if cpu_runtime.is_active():
        sender.supports_host_tensor_indices = False


def no_early_prefix_send(
    maybe_send_cached_prefix_chunk: Callable[..., None], scheduler: Any, req: Any,
    *args: Any, **kwargs: Any,
) -> None:
    """AROUND ``SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk``: on a CPU
    under overlap scheduling the cached prefix is sent with the rest of the request."""
    if cpu_runtime.is_active() and getattr(scheduler, "enable_overlap", False):
        return None
    return maybe_send_cached_prefix_chunk(scheduler, req, *args, **kwargs)
