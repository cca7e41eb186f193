"""KTO data under grimoire-rl's module path (``grimoire.data.kto``); a facade."""

from grimoire.collate.kto import KTOCollator
from grimoire.rows.kto import tokenize_kto

__all__ = ["KTOCollator", "tokenize_kto"]
