"""Names SGLang's linear-attention (GDN/KDA) backends import; no CPU stand-in exists."""

from sgl_kernel import _unimplemented

chunk_gated_delta_rule_cpu = _unimplemented("mamba.chunk_gated_delta_rule_cpu")
causal_conv1d_fn_cpu = _unimplemented("mamba.causal_conv1d_fn_cpu")
causal_conv1d_update_cpu = _unimplemented("mamba.causal_conv1d_update_cpu")
