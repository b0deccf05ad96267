"""Paged attention as the model sees it: the step's metadata (built by the model runner, read by
every layer) and the KV layout live with the kernels that read them, in kernels/attention.py;
each backend (kernels/backend.py) runs `paged_attention` and the K/V cache write."""

from __future__ import annotations

from brisk.kernels.attention import AttentionMetadata, PrefillBatch, PrefillSpan

__all__ = ["AttentionMetadata", "PrefillBatch", "PrefillSpan"]
