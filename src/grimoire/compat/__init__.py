"""Other systems' names, translated at the edge: grimoire-rl's, TRL's and mini_trainer's.

Everything here exists only so that code, configs and command lines written for another system
keep working (or are answered with Grimoire's spelling):

* :mod:`~grimoire.compat.grimoire_rl_registry`: grimoire-rl's ``grimoire.registry``;
* :mod:`~grimoire.compat.grimoire_rl_data`: the names of grimoire-rl's ``grimoire.data.*``
  modules;
* :mod:`~grimoire.compat.grimoire_rl_methods`: grimoire-rl's spelling of the online methods'
  constructors and its prompt columns;
* :mod:`~grimoire.compat.trl_names`: TRL's config keys, answered with the keys that do it here;
* :mod:`~grimoire.compat.mini_trainer`: mini_trainer's command-line flags.

The core never imports this package: only the entry points (``cli/``, ``tools/``), the public
modules at grimoire-rl's paths (``grimoire.registry``, ``grimoire.data.sft``, ...) and, for the
constructor spelling users write in Python, ``losses/online.py`` do. ``pyproject.toml``'s
import-linter contracts and ``tests/test_architecture.py`` check it.
"""
