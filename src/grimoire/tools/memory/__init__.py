"""``grimoire estimate-memory``: per-rank peak memory of a run, part by part, without loading it.

:func:`~grimoire.tools.memory.run_config.plan_from_config` reads a ``grimoire train`` config,
:func:`~grimoire.tools.memory.estimate.estimate` counts the bytes (its module docstring lists
every assumption), :mod:`~grimoire.tools.memory.report` prints the tables.
"""

from grimoire.config.model_shape import LoraShape, ModelShape, shape_from_config
from grimoire.tools.memory.estimate import GIB, Estimate, Part, Rollout, Setup, estimate
from grimoire.tools.memory.run_config import RunPlan, plan_from_config
from grimoire.tools.memory.shape import load_shape

__all__ = [
    "GIB",
    "Estimate",
    "LoraShape",
    "ModelShape",
    "Part",
    "Rollout",
    "RunPlan",
    "Setup",
    "estimate",
    "load_shape",
    "plan_from_config",
    "shape_from_config",
]
