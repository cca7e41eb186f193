"""What scores the completions: reward functions, how they are called and resolved, the
built-ins, and reward statistics.

The names of :mod:`grimoire.rollout.rewards.scoring` are re-exported here, so the import path
``grimoire.rollout.rewards`` (and specs such as ``grimoire.rollout.rewards:exact_match_reward``)
reads them as before.
"""

from grimoire.rollout.rewards.scoring import *  # noqa: F403 (scoring's names, listed once there)
