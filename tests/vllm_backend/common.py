"""What the vLLM tests share."""

from __future__ import annotations

#: Passed to save_tiny / build_model: 2 heads of 64 (vLLM's CPU kernels refuse head size 16).
TINY = dict(hidden_size=128, num_layers=2, num_attention_heads=2, num_key_value_heads=2)
