"""The repeated transformer blocks of a model: what FSDP2 shards and ``torch_compile`` compiles;
and the transformers model under a PEFT wrapper."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def peft_base(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model a PEFT wrapper holds (``get_base_model()``), else ``model``."""
    get_base = getattr(model, "get_base_model", None)
    return cast("PreTrainedModel", get_base() if callable(get_base) else model)


def block_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated transformer blocks: modules whose class is in the HF model's
    ``_no_split_modules`` (``LlamaDecoderLayer``, ...), found through peft wrappers too."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            f"distributed='fsdp2': no transformer blocks found in {type(model).__name__} (its "
            "_no_split_modules is empty); shard a transformers model, or use distributed='ddp'"
        )
    return blocks


__all__ = ["block_modules", "peft_base"]
