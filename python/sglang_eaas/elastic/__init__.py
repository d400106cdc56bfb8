"""Elastic expert tier: resize plans and operations, the autoscaler (docs/elastic.md)."""
