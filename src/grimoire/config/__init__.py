"""Configuration: what a run is (``TrainingConfig``, the plug-in registry) and the context a method sees."""

from grimoire.config.training import TrainingConfig

__all__ = ["TrainingConfig"]
