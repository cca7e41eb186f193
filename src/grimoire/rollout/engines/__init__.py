"""What samples an online method's completions: the engine interface (``base.py``) and its
backends (HF ``generate``, its sampler process, vLLM colocated and a ``grimoire vllm-serve``
client)."""
