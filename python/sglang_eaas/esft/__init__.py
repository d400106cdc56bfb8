"""ESFT adapters (Expert-Specialized Fine-Tuning, Wang et al. 2024): a few routed experts per
MoE layer replaced, everything else shared with the base model (docs/esft.md).

The adapter format and its checks are ``adapter.py``; the text domains adapters are trained on
``domains.py``, or ESFT's JSON-lines data files ``data.py``; ESFT's expert selection
``relevance.py`` and its training ``finetune.py``;
random adapters for tests and merged checkpoints ``edit.py`` (all driven by
``python -m sglang_eaas.tools.esft``). The other modules serve adapters over the expert tier.
"""

from sglang_eaas.esft.adapter import AdapterError, EsftAdapter, load_adapter, write_adapter

__all__ = ["AdapterError", "EsftAdapter", "load_adapter", "write_adapter"]
