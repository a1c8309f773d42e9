"""Kimi K3 for transformers."""
