"""The expert server: a stateless process that runs some routed experts of every MoE layer."""
