"""A model's shape read from its config alone: the one reader of an HF config's sizes.

:func:`shape_from_config` turns a transformers config object or a ``config.json`` mapping into a
:class:`ModelShape` (hidden size, layers, heads, key/value heads, head size, MLP width,
vocabulary, tied head, q/k/v biases, the checkpoint's dtype). The memory estimates
(``model/activations.py``, ``grimoire estimate-memory``), the CPU vLLM KV-cache size and the
varlen-kernel check all read a model's sizes through it, so they cannot read them differently.
It models Llama-shaped decoders (Llama, Qwen2, Mistral, Gemma, ...): a token embedding, ``L``
layers of RMSNorm + attention (``q/k/v/o`` projections, grouped-query heads) + RMSNorm + gated
MLP (``gate/up/down``), a final norm and an LM head (tied or not).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grimoire.errors import ConfigError

#: The config keys that define a decoder's weight shapes: a served model and the policy whose
#: weights it receives must agree on them.
SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
#: Bytes per element of the dtypes a checkpoint or a run may name.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: The seven projections of a Llama layer, as peft's ``target_modules`` names them.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Which norm's output each projection reads (the MLP's down_proj reads the gated product).
INPUT_OF = {
    "q_proj": "attn_norm",
    "k_proj": "attn_norm",
    "v_proj": "attn_norm",
    "o_proj": "attention",
    "gate_proj": "mlp_norm",
    "up_proj": "mlp_norm",
    "down_proj": "product",
}
#: peft's default ``target_modules`` for these architectures (its
#: TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING): query and value projections.
PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")


@dataclass(frozen=True)
class ModelShape:
    """A Llama-shaped decoder's sizes. ``dtype``: the checkpoint's (what ``dtype="auto"`` loads)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    dtype: str = "float32"
    name: str = "model"

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shape(self, name: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of one projection of a layer."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_width, self.intermediate
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }[name]

    def linear_params(self, name: str) -> int:
        fan_in, fan_out = self.linear_shape(name)
        bias = fan_out if self.qkv_bias and name in ("q_proj", "k_proj", "v_proj") else 0
        return fan_in * fan_out + bias

    @property
    def layer_linear_params(self) -> int:
        return sum(self.linear_params(n) for n in LINEARS)

    @property
    def layer_params(self) -> int:
        """One decoder layer: its projections and its two RMSNorm weights."""
        return self.layer_linear_params + 2 * self.hidden

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """The LM head's own weight (0 when tied to the embedding)."""
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def root_params(self) -> int:
        """Everything outside the layers: embedding, final norm, LM head (FSDP2's root unit)."""
        return self.embed_params + self.hidden + self.head_params

    @property
    def total_params(self) -> int:
        return self.layers * self.layer_params + self.root_params


@dataclass(frozen=True)
class LoraShape:
    """A LoRA adapter: rank, the projections it wraps, dropout, and modules trained in full."""

    r: int = 8
    targets: tuple[str, ...] = PEFT_DEFAULT_TARGETS
    dropout: float = 0.0
    #: Modules peft trains as full copies (``modules_to_save``): ``lm_head``, ``embed_tokens``.
    modules_to_save: tuple[str, ...] = field(default=())

    def adapter_params(self, shape: ModelShape) -> int:
        """``A`` (r x in) and ``B`` (out x r) of every wrapped projection of every layer."""
        per_layer = sum(self.r * sum(shape.linear_shape(t)) for t in self.targets)
        return shape.layers * per_layer

    def saved_params(self, shape: ModelShape) -> int:
        """The trained full copies of ``modules_to_save``."""
        sizes = {"lm_head": shape.vocab * shape.hidden, "embed_tokens": shape.embed_params}
        return sum(sizes.get(m, 0) for m in self.modules_to_save)

    @property
    def trains_head(self) -> bool:
        return "lm_head" in self.modules_to_save


def dtype_name(value: Any) -> str:
    """``torch.bfloat16`` / ``"bf16"`` / ``"bfloat16"`` -> ``"bfloat16"``; unknown -> float32."""
    text = str(value or "float32").removeprefix("torch.")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}
    text = aliases.get(text, text)
    return text if text in DTYPE_BYTES else "float32"


def text_config(config: Any) -> Any:
    """The decoder's own config: ``get_text_config()`` of a multimodal config, else itself; a
    ``config.json`` mapping is read like a config object."""
    if isinstance(config, dict):
        config = _Attrs(config)
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def experts_of(config: Any) -> int:
    """How many experts a mixture-of-experts config routes between (1: a dense model)."""
    text = text_config(config)
    names = ("num_local_experts", "num_experts", "n_routed_experts")
    counts = [getattr(text, k, None) for k in names]
    return max([c for c in counts if isinstance(c, int)] + [1])


def shape_from_config(config: Any, name: str = "model") -> ModelShape:
    """A :class:`ModelShape` from a transformers config object or a ``config.json`` mapping; a
    :class:`~grimoire.errors.ConfigError` naming the missing sizes when it does not give them."""
    if isinstance(config, dict):
        config = _Attrs(config)
    text = text_config(config)
    missing = [
        k
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        if not isinstance(getattr(text, k, None), int)
    ]
    if missing:
        raise ConfigError(
            [f"{name}: the config does not give {', '.join(missing)} (not a decoder-only LM?)"]
        )
    hidden, heads = text.hidden_size, text.num_attention_heads
    return ModelShape(
        hidden=hidden,
        layers=text.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or hidden // heads,
        intermediate=getattr(text, "intermediate_size", None) or 4 * hidden,
        vocab=text.vocab_size,
        tied=bool(
            getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False))
        ),
        # Qwen2 always has q/k/v biases; Llama-style configs say so with attention_bias.
        qkv_bias=getattr(text, "model_type", "") == "qwen2"
        or bool(getattr(text, "attention_bias", False)),
        dtype=dtype_name(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)),
        name=name,
    )


class _Attrs:
    """A ``config.json`` mapping read like a config object (no transformers needed)."""

    def __init__(self, values: dict[str, Any]):
        self.__dict__.update(values)
        if isinstance(values.get("text_config"), dict):
            self.get_text_config = lambda: _Attrs({**values, **values["text_config"]})


__all__ = [
    "DTYPE_BYTES",
    "INPUT_OF",
    "LINEARS",
    "PEFT_DEFAULT_TARGETS",
    "SHAPE_KEYS",
    "LoraShape",
    "ModelShape",
    "dtype_name",
    "experts_of",
    "shape_from_config",
    "text_config",
]
