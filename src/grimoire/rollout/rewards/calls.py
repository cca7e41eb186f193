"""How reward functions are called (keywords only, as TRL's GRPOTrainer) and resolved from configs.

Every reward function is called once per rollout batch with keyword arguments only::

    fn(prompts=[...], completions=[...], completion_ids=[[...], ...], answer=[...], ...)

one entry per completion (a prompt sampled ``G`` times appears ``G`` times): ``prompts`` (the
prompt text), ``completions`` (the decoded completion), ``completion_ids`` (its sampled token ids,
EOS included when it stopped on one) and every dataset column besides the prompt (:data:`CALL_KEYWORDS`
win over a column of the same name). A function with ``**kwargs`` receives all of them; one without
receives only those it names (so grimoire-rl's ``fn(prompts, completions)`` keeps working).
grimoire-rl's ``fn(prompts, completions, metadata)`` gets ``metadata[i]``, the dict of completion
``i``'s columns. Because the call is by keyword, a function's parameters must carry these names:
:meth:`RewardFunction.signature_problems` says which one the call would not supply, before training.

From a config, an entry is a callable, a short name of
:data:`grimoire.config.registry.REWARD_FUNCS`, a ``package.module:function`` spec, or
``{"type": name_or_spec, "args": {...}}``: a class is instantiated with ``args`` (the built-ins
with options are classes), a function gets them bound with :func:`functools.partial`. **Resolving a spec imports that module, which runs its code**.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from grimoire.config.registry import REWARD_FUNCS, resolve
from grimoire.errors import ConfigError

RewardFn = Callable[..., Sequence[float]]
#: What one entry of ``reward_funcs`` may be.
RewardSpec = RewardFn | str | Mapping[str, Any]
#: The keywords every call supplies besides the dataset columns (TRL's names).
CALL_KEYWORDS = ("prompts", "completions", "completion_ids")
#: Keys of a prompt micro-batch that are not passed as columns (``prompt`` is ``prompts``).
NOT_COLUMNS = ("prompt_input_ids", "prompt_attention_mask", "prompt", "prompt_messages")
#: The keys of a ``{"type": ..., "args": ...}`` entry.
ENTRY_KEYS = ("type", "args")


class RewardBatch(list):
    """A reward function's rewards (a list of floats) with counts about the call that made them
    (an LLM judge's ``failures``): each ``metrics`` entry is summed over a step's calls and logged
    as ``rewards/<name>/<key>``. A plain list needs none of this."""

    def __init__(self, values: Iterable[float], metrics: Mapping[str, float] | None = None):
        super().__init__(values)
        self.metrics = dict(metrics or {})


@dataclass
class RewardFunction:
    """A reward callable with the name it is logged under and its weight in the total."""

    fn: RewardFn
    name: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        # Read once: the signature decides both the checks before training and every call.
        try:
            self._params = list(inspect.signature(self.fn).parameters.values())
        except (TypeError, ValueError):
            self._params = []  # unreadable (a C callable): pass everything, check nothing
        names = {p.name for p in self._params}
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in self._params)
        #: grimoire-rl's convention: ``metadata[i]`` is the dict of completion ``i``'s columns.
        self.takes_metadata = "metadata" in names and not takes_kwargs
        #: The keywords passed: all (None) for ``**kwargs`` or an unreadable signature, else
        #: the parameter names (a function is never handed a keyword it cannot take).
        self._accepted: set[str] | None = None if takes_kwargs or not self._params else names
        #: Options bound by a ``{type, args}`` entry: a column of the same name must not
        #: override them.
        self._bound = set(self.fn.keywords) if isinstance(self.fn, functools.partial) else set()

    @property
    def overlap_sampling(self) -> bool:
        """Whether the callable declared itself slow and thread-safe (``overlap_sampling = True``,
        as an LLM judge does): the stage then scores a micro-batch in the background while the
        next samples (:mod:`grimoire.rollout.rewards.background`)."""
        return bool(getattr(self.fn, "overlap_sampling", False))

    def keywords(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        columns: Mapping[str, list[Any]],
        completion_ids: Sequence[Sequence[int]] | None = None,
    ) -> dict[str, Any]:
        """The keyword arguments of one call (see the module docstring)."""
        supplied: dict[str, Any] = dict(columns)
        if self.takes_metadata and "metadata" not in columns:
            n = len(completions)
            supplied["metadata"] = [{k: v[i] for k, v in columns.items()} for i in range(n)]
        supplied.update(prompts=list(prompts), completions=list(completions))
        if completion_ids is not None:
            supplied["completion_ids"] = [list(map(int, ids)) for ids in completion_ids]
        return {
            k: v
            for k, v in supplied.items()
            if (self._accepted is None or k in self._accepted) and k not in self._bound
        }

    def __call__(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        columns: Mapping[str, list[Any]],
        completion_ids: Sequence[Sequence[int]] | None = None,
    ) -> Any:
        """The function's raw output for ``N`` completions, called with keywords only."""
        return self.fn(**self.keywords(prompts, completions, columns, completion_ids))

    def required_columns(self) -> list[str]:
        """Dataset columns the function needs: its parameters without a default that the call
        supplies no other way (not a :data:`CALL_KEYWORDS` nor grimoire-rl's ``metadata``), and
        the ``required_columns`` a callable object declares (e.g. ``AnswerMatch``'s
        ``answer_field``, read from ``**kwargs``)."""
        builtin = set(CALL_KEYWORDS) | ({"metadata"} if self.takes_metadata else set())
        named = [
            p.name
            for p in self._params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty
        ]
        declared = [str(c) for c in getattr(self.fn, "required_columns", ())]
        return list(dict.fromkeys(n for n in [*named, *declared] if n not in builtin))

    def signature_problems(self, columns: Iterable[str], where: str = "dataset") -> list[str]:
        """Why a call with ``columns`` (besides :data:`CALL_KEYWORDS`) would fail on the
        signature: a required parameter it does not supply, or one it cannot pass by keyword."""
        available = sorted(set(columns))
        problems = [
            f"reward function {self.name!r}: parameter {p.name!r} is positional-only, but reward "
            f"functions are called with keywords only ({', '.join(CALL_KEYWORDS)} and the "
            "dataset columns)"
            for p in self._params
            if p.kind is p.POSITIONAL_ONLY and p.default is p.empty
        ]
        for name in self.required_columns():
            if name not in available:
                problems.append(
                    f"{where}: reward function {self.name!r} needs {name!r}, which the call does "
                    f"not supply: it passes {', '.join(CALL_KEYWORDS)} and the {where}'s columns "
                    f"{available} as keywords (name the parameters so, or give the column)"
                )
        return problems


def reward_signature_problems(
    funcs: Sequence[RewardFunction], columns: Iterable[str], where: str = "dataset"
) -> list[str]:
    """Every reward function's :meth:`RewardFunction.signature_problems` for a dataset whose
    columns are ``columns`` (the prompt batch keys of :data:`NOT_COLUMNS` are not passed)."""
    passed = [c for c in columns if c not in NOT_COLUMNS]
    return [p for rf in funcs for p in rf.signature_problems(passed, where)]


def build_reward(entry: RewardSpec, where: str) -> Any:
    """One ``reward_funcs`` entry -> a callable (or raises :class:`ConfigError` naming ``where``).

    A class (a short name such as ``answer_match``) is instantiated with the entry's ``args``; a
    function gets them bound with :func:`functools.partial`; a callable object is used as it is.
    """
    args: Mapping[str, Any] = {}
    if isinstance(entry, Mapping):
        unknown = [k for k in entry if k not in ENTRY_KEYS]
        if unknown or "type" not in entry:
            raise ConfigError(
                [
                    f"{where}: expected {{type: <name or spec>, args: {{...}}}}, got keys {list(entry)}"
                ]
            )
        args = entry.get("args") or {}
        if not isinstance(args, Mapping):
            raise ConfigError([f"{where}.args: expected a mapping, got {args!r}"])
        entry = entry["type"]
        where = f"{where}.type"
    target: Any = resolve(entry, REWARD_FUNCS, where) if isinstance(entry, str) else entry
    if not callable(target):
        raise ConfigError([f"{where}: {entry!r} is not callable"])
    if not isinstance(target, type) and not args:
        return target
    try:
        if not isinstance(target, type):  # a function with options: bind them, checked now
            inspect.signature(target).bind_partial(**args)
            return functools.partial(target, **args)
        return target(**args)
    except (TypeError, ValueError) as exc:
        raise ConfigError([f"{where.removesuffix('.type')}: {entry}: {exc}"]) from exc


def reward_name(fn: Any) -> str:
    """The name a reward is logged under: ``__name__`` (a partial's function's, an object's
    class's when it has none)."""
    base = getattr(fn, "func", fn) if isinstance(fn, functools.partial) else fn
    return getattr(base, "__name__", None) or type(base).__name__


def resolve_reward_funcs(
    reward_funcs: RewardSpec | Sequence[RewardSpec],
    reward_weights: Sequence[float] | None = None,
) -> list[RewardFunction]:
    """Callables, short names, specs or ``{type, args}`` entries -> :class:`RewardFunction` s.

    Names are :func:`reward_name`, made unique with a ``_2`` suffix. Raises :class:`ConfigError`
    listing every unimportable spec, bad option, non-callable and bad weight, so a config is
    fixed in one pass, before any model is loaded.
    """
    if callable(reward_funcs) or isinstance(reward_funcs, str | Mapping):
        reward_funcs = [cast(RewardSpec, reward_funcs)]
    funcs = list(cast(Sequence[RewardSpec], reward_funcs))
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
        try:
            fn = build_reward(spec, f"reward_funcs[{i}]")
        except ConfigError as exc:
            problems += exc.problems
            continue
        base = reward_name(fn)
        seen[base] = seen.get(base, 0) + 1
        name = base if seen[base] == 1 else f"{base}_{seen[base]}"
        weight = float(w) if isinstance(w, int | float) else 1.0
        # A callable; what it returns is checked each time it scores (RewardFunctionError).
        out.append(RewardFunction(fn=cast(RewardFn, fn), name=name, weight=weight))
    if problems:
        raise ConfigError(problems, title="invalid reward functions")
    return out


__all__ = [
    "CALL_KEYWORDS",
    "NOT_COLUMNS",
    "RewardBatch",
    "RewardFn",
    "RewardFunction",
    "RewardSpec",
    "build_reward",
    "resolve_reward_funcs",
    "reward_name",
    "reward_signature_problems",
]
