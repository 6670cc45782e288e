"""Repair policies for reused segment KV: which spliced tokens to recompute (registry.py names them)."""
