"""SGLang's torch-native attention backend (the CPU runtime's) under two-batch overlap.

Two-batch overlap makes every batch go through ``ForwardBatch.prepare_mlp_sync_batch``, which
pads the batch's inputs and, on a CPU, asks the attention backend for the value padded
sequence lengths take (``get_cpu_graph_seq_len_fill_value``). SGLang's Intel AMX backend has
it (1); its torch-native backend, the one that runs on any CPU, does not.
"""

from __future__ import annotations

from typing import Any


def _one() -> int:
    return 1  # as SGLang's CPU (Intel AMX) backend: a padded request attends one token


def add_seq_len_fill_value(_result: Any, backend: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``TorchNativeAttnBackend.__init__``."""
    if not hasattr(backend, "get_cpu_graph_seq_len_fill_value"):
        backend.get_cpu_graph_seq_len_fill_value = _one
