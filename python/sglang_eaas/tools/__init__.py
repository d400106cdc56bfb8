"""Command-line tools that ship with sglang-eaas (``python -m sglang_eaas.tools.<name>``)."""
