"""Reward functions for online RL: plain callables, resolvable from YAML, scored with checks.

A reward function is any callable

    reward_fn(prompts: list[str], completions: list[str], **columns) -> list[float]

(or grimoire-rl's ``reward_fn(prompts, completions, metadata)``, where ``metadata[i]`` is the dict
of completion ``i``'s columns)

called once per rollout batch with one entry per *completion* (a prompt sampled G times appears
G times). ``columns`` are the dataset's other fields (e.g. ``answer``), repeated the same way, so
``columns["answer"][i]`` belongs to ``completions[i]``. A function with ``**kwargs`` receives every
column; one without gets the columns it names (so grimoire-rl's two-argument
``reward_fn(prompts, completions)`` works as it is). Several functions may be combined with weights; the method trains on
``sum_k w_k * r_k`` and logs each ``r_k`` as ``rewards/<name>/mean``.

From YAML a reward function is named by a built-in short name (:data:`REWARD_FUNCS`) or a
``package.module:function`` spec. **Resolving a spec imports that module, which runs its code**:
only use configs you trust (see :mod:`grimoire.config.registry`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from grimoire.columns import pad_token_id_of
from grimoire.config.registry import resolve
from grimoire.errors import ConfigError
from grimoire.rollout.hf import HFGenerateEngine
from grimoire.rows.prompts import tokenize_grpo

RewardFn = Callable[..., Sequence[float]]

#: Built-in reward functions by short name (``loss.args.reward_funcs: [char_match]`` in YAML).
REWARD_FUNCS: dict[str, str] = {
    "exact_match": "grimoire.rollout.rewards:exact_match_reward",
    "char_match": "grimoire.rollout.rewards:char_match_reward",
}


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned something that is not one number per completion."""


# --------------------------------------------------------------------------------------------
# built-in rewards for the toy reverse task (and any task with a reference ``answer`` column)
# --------------------------------------------------------------------------------------------


def exact_match_reward(
    prompts: list[str], completions: list[str], answer: list[Any], **kwargs: Any
) -> list[float]:
    """1.0 where ``completion.strip() == str(answer).strip()``, else 0.0."""
    del prompts, kwargs
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


def char_match_reward(
    prompts: list[str], completions: list[str], answer: list[Any], **kwargs: Any
) -> list[float]:
    """Partial credit: matching characters at equal positions / ``max(len(c), len(a))``.

    In ``[0, 1]``; 1.0 only for an exact match (after ``strip``), and extra or missing characters
    cost credit, so it is a dense version of :func:`exact_match_reward` that a small policy can
    climb in few steps.
    """
    del prompts, kwargs
    out = []
    for c, a in zip(completions, answer):
        c, a = c.strip(), str(a).strip()
        width = max(len(c), len(a))
        out.append(sum(x == y for x, y in zip(c, a)) / width if width else 1.0)
    return out


# --------------------------------------------------------------------------------------------
# resolution and scoring
# --------------------------------------------------------------------------------------------


@dataclass
class RewardFunction:
    """A reward callable with the name it is logged under and its weight in the total."""

    fn: RewardFn
    name: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        # Read once: the signature decides both the column check and how each call passes them.
        try:
            self._params = list(inspect.signature(self.fn).parameters.values())
        except (TypeError, ValueError):
            self._params = []
        names = {p.name for p in self._params}
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in self._params)
        #: grimoire-rl's convention: ``fn(prompts, completions, metadata)``, ``metadata[i]`` the
        #: dict of completion ``i``'s columns (``metadata_fields`` of ``tokenize_grpo``).
        self.takes_metadata = "metadata" in names and not takes_kwargs
        #: Columns are passed by the names the function takes; one without ``**kwargs`` (e.g.
        #: grimoire-rl's two-argument ``fn(prompts, completions)``) gets only those. None: all
        #: (``**kwargs``, or a signature that cannot be read).
        self._accepted: set[str] | None = None if takes_kwargs or not self._params else names

    def __call__(
        self, prompts: list[str], completions: list[str], columns: Mapping[str, list[Any]]
    ) -> Any:
        """The function's raw output for ``N`` completions (columns by name, or as metadata)."""
        if self.takes_metadata and "metadata" not in columns:
            n = len(completions)
            metadata = [{k: v[i] for k, v in columns.items()} for i in range(n)]
            return self.fn(list(prompts), list(completions), metadata=metadata)
        passed = {k: v for k, v in columns.items() if self._accepted is None or k in self._accepted}
        return self.fn(list(prompts), list(completions), **passed)

    def required_columns(self) -> list[str]:
        """Keyword parameters without a default besides ``prompts``/``completions`` (and a
        grimoire-rl ``metadata``, which is built from all columns).

        These must be dataset columns; checked before training. Unknown for ``*args``-style
        callables (returns what can be seen).
        """
        params = [p for p in self._params if not (self.takes_metadata and p.name == "metadata")]
        named = [
            p
            for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty
        ]
        # The first two positional parameters receive prompts and completions, whatever named.
        positional = [p for p in named if p.kind is p.POSITIONAL_OR_KEYWORD]
        skip = {p.name for p in positional[:2]}
        return [p.name for p in named if p.name not in skip]


def resolve_reward_funcs(
    reward_funcs: RewardFn | str | Sequence[RewardFn | str],
    reward_weights: Sequence[float] | None = None,
) -> list[RewardFunction]:
    """Callables, short names or ``package.module:function`` specs -> :class:`RewardFunction` s.

    Names are the function's ``__name__`` (a spec's attribute name), made unique with a ``_2``
    suffix. Raises :class:`ConfigError` listing every unimportable spec, non-callable and bad
    weight, so a config is fixed in one pass, before any model is loaded.
    """
    if callable(reward_funcs) or isinstance(reward_funcs, str):
        reward_funcs = [reward_funcs]
    funcs = list(reward_funcs)
    problems: list[str] = []
    if not funcs:
        problems.append("reward_funcs: at least one reward function is needed")
    if reward_weights is not None and len(reward_weights) != len(funcs):
        problems.append(
            f"reward_weights has {len(reward_weights)} entries but there are {len(funcs)} "
            "reward functions"
        )
    weights = list(reward_weights) if reward_weights is not None else [1.0] * len(funcs)
    for i, w in enumerate(weights):
        if not isinstance(w, int | float) or not math.isfinite(w):
            problems.append(f"reward_weights[{i}] must be a finite number, got {w!r}")
    out: list[RewardFunction] = []
    seen: dict[str, int] = {}
    for i, (spec, w) in enumerate(zip(funcs, weights)):
        fn: Any = spec
        if isinstance(spec, str):
            try:
                fn = resolve(spec, REWARD_FUNCS, f"reward_funcs[{i}]")
            except ConfigError as exc:
                problems += exc.problems
                continue
        if not callable(fn):
            problems.append(f"reward_funcs[{i}]: {spec!r} is not callable")
            continue
        base = getattr(fn, "__name__", None) or type(fn).__name__
        seen[base] = seen.get(base, 0) + 1
        name = base if seen[base] == 1 else f"{base}_{seen[base]}"
        weight = float(w) if isinstance(w, int | float) else 1.0
        # A callable; what it returns is checked each time it scores (RewardError).
        out.append(RewardFunction(fn=cast(RewardFn, fn), name=name, weight=weight))
    if problems:
        raise ConfigError(problems, title="invalid reward functions")
    return out


def score_completions(
    reward_funcs: Sequence[RewardFunction],
    prompts: list[str],
    completions: list[str],
    columns: Mapping[str, list[Any]],
    device: torch.device | str = "cpu",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Run every reward function and combine them: ``total = sum_k w_k * r_k``.

    Shapes: ``prompts``, ``completions`` and every ``columns`` list have length ``N`` ->
    ``total [N]`` float32 and ``{name: r_k [N]}``. A function that raises, returns a non-sequence,
    the wrong length, or a non-finite / non-numeric entry raises :class:`RewardFunctionError`
    naming it (and the first bad entry), instead of a shape error deep in the loss.
    """
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"{len(prompts)} prompts for {n} completions")
    per_func: dict[str, Tensor] = {}
    total = torch.zeros(n, dtype=torch.float32)
    for rf in reward_funcs:
        try:
            values = rf(prompts, completions, columns)
        except Exception as exc:
            raise RewardFunctionError(
                f"reward function {rf.name!r} raised {type(exc).__name__}: {exc} "
                f"(called with {n} completions and columns {sorted(columns)})"
            ) from exc
        per_func[rf.name] = _as_rewards(values, n, rf.name)
        total += rf.weight * per_func[rf.name]
    return total.to(device), {k: v.to(device) for k, v in per_func.items()}


@torch.no_grad()
def evaluate_rewards(
    model: torch.nn.Module,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    reward_funcs: RewardFn | str | Sequence[RewardFn | str],
    *,
    prompt_field: str = "prompt",
    num_samples: int = 1,
    greedy: bool = True,
    temperature: float = 1.0,
    max_new_tokens: int = 64,
    seed: int = 0,
    batch_size: int = 64,
) -> dict[str, float]:
    """Mean reward of ``model`` on raw ``rows`` (held-out prompts), per function and total.

    ``greedy=True``: one greedy completion per prompt. ``greedy=False``: ``num_samples``
    completions per prompt at ``temperature`` (the policy's *expected* reward, what online RL
    maximises), drawn from a forked RNG seeded with ``seed`` so the caller's RNG is untouched and
    two models are compared on the same random stream. Prompts are encoded like
    :func:`grimoire.rows.prompts.tokenize_grpo`; the other fields of each row are the reward
    columns. Returns ``{"reward": total mean, "<name>": mean, ...}``.
    """
    funcs = resolve_reward_funcs(reward_funcs)
    n = 1 if greedy else num_samples
    engine = HFGenerateEngine(max_new_tokens=max_new_tokens, temperature=temperature)
    pad = pad_token_id_of(tokenizer, model)
    engine.bind(model, pad, tokenizer.eos_token_id)
    sums: dict[str, float] = {}
    count = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(rows), batch_size):
            chunk = [
                tokenize_grpo(r, tokenizer, 10**9, prompt_field)
                for r in rows[start : start + batch_size]
            ]
            rollout = engine.generate(
                [c["prompt_input_ids"] for c in chunk], n, with_old_logps=False, greedy=greedy
            )
            texts = tokenizer.batch_decode(
                [
                    i[m.bool()].tolist()
                    for i, m in zip(rollout.completion_ids.cpu(), rollout.completion_mask.cpu())
                ],
                skip_special_tokens=True,
            )
            skip = ("prompt_input_ids", "prompt_attention_mask", "prompt")
            columns = {
                k: [c[k] for c in chunk for _ in range(n)] for k in chunk[0] if k not in skip
            }
            prompts = [c["prompt"] for c in chunk for _ in range(n)]
            total, per_func = score_completions(funcs, prompts, texts, columns)
            for name, values in [("reward", total), *per_func.items()]:
                sums[name] = sums.get(name, 0.0) + float(values.sum())
            count += len(texts)
    return {k: v / max(count, 1) for k, v in sums.items()}


def _as_rewards(values: Any, n: int, name: str) -> Tensor:
    if isinstance(values, Tensor):
        values = values.detach().cpu().flatten().tolist()
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise RewardFunctionError(
            f"reward function {name!r} returned {type(values).__name__}; expected a list of "
            f"{n} floats (one per completion)"
        )
    if len(values) != n:
        raise RewardFunctionError(
            f"reward function {name!r} returned {len(values)} rewards for {n} completions "
            "(it must return one float per completion)"
        )
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool):
            v = float(v)
        if not isinstance(v, int | float) or not math.isfinite(v):
            raise RewardFunctionError(
                f"reward function {name!r} returned {v!r} at index {i}; rewards must be finite "
                "numbers"
            )
        out.append(float(v))
    return torch.tensor(out, dtype=torch.float32)


__all__ = [
    "REWARD_FUNCS",
    "RewardFunction",
    "RewardFunctionError",
    "char_match_reward",
    "evaluate_rewards",
    "exact_match_reward",
    "resolve_reward_funcs",
    "score_completions",
]
