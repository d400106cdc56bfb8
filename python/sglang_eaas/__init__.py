"""sglang-eaas: Expert-as-a-Service for SGLang.

Attention runs in SGLang (the attention client); the routed experts of every MoE layer run on
separate, stateless expert servers. This package is an SGLang plugin (entry point group
``sglang.srt.plugins``); importing it is cheap and never imports torch or SGLang.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``sglang_eaas.Engine`` (``launcher/engine.py``), imported on first use: importing the
    package stays cheap."""
    if name == "Engine":
        from sglang_eaas.launcher.engine import Engine

        return Engine
    raise AttributeError(f"module 'sglang_eaas' has no attribute {name!r}")
