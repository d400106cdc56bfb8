"""Capacity planning: a discrete-event model of the disaggregated tier (attention clients, expert
servers, the P2P fabric) on a hardware profile, and a search for the cheapest deployment that
meets an SLO (``python -m sglang_eaas.plan``; docs/planning.md). Nothing else in the package
imports this one."""
