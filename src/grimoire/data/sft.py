"""SFT data under grimoire-rl's module path: ``from grimoire.data.sft import PackedSFTCollator``
(and ``SFTCollator``, ``tokenize_sft``) works as it did there. A facade, like
:mod:`grimoire.data`."""

from grimoire.collate.sft import PackedSFTCollator, SFTCollator
from grimoire.rows.sft import tokenize_sft

__all__ = ["PackedSFTCollator", "SFTCollator", "tokenize_sft"]
