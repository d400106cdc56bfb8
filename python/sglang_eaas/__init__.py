"""sglang-eaas: Expert-as-a-Service for SGLang.

Attention runs in SGLang (the attention client); the routed experts of every MoE layer run on
separate, stateless expert servers. This package is an SGLang plugin (entry point group
``sglang.srt.plugins``); importing it is cheap and never imports torch or SGLang.
"""

__version__ = "0.1.0"
