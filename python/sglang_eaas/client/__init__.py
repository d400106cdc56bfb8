"""The attention-client side: connections to expert servers and the MoE dispatch/combine."""
