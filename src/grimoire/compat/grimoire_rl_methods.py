"""grimoire-rl 2.x's spelling of the online methods' constructors, accepted by every one of them.

grimoire-rl writes ``GRPOMethod(reward_fn, tokenizer, num_generations=4, ...)`` (the same for
RLOO, Online DPO and RAFT); Grimoire writes ``GRPOMethod(reward_funcs, ...)`` and takes the
tokenizer from the trainer. :func:`accepts_peer_spelling` wraps a method's ``__init__`` so both
spellings work:

- ``reward_fn=`` is ``reward_funcs`` (one function or a list);
- ``tokenizer=``, or a tokenizer as the SECOND positional argument, is kept as
  ``peer_tokenizer`` and checked against the trainer's at set-up (:func:`tokenizer_problem`):
  the methods decode and encode with the trainer's, so a different one would be silently
  ignored otherwise. A second positional argument is taken for the tokenizer only when it is a
  tokenizer (an object with ``encode`` and ``decode``): no Grimoire argument at that position
  (RLOO's ``num_generations``, RAFT's ``reward_threshold``, ...) can hold one, so nothing that
  binds today changes meaning. grimoire-rl's positional arguments after the tokenizer are
  refused with a message: their positions differ here, and a silent shift would bind a value to
  the wrong name.

grimoire-rl's ``tokenize_grpo`` writes the prompt as ``input_ids`` / ``attention_mask`` (and no
prompt text); :func:`peer_prompt_rows` reads such a dataset (e.g. one saved with
``save_to_disk``) as Grimoire's prompt columns.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from grimoire.columns import columns_of

#: grimoire-rl's name for ``reward_funcs``.
PEER_REWARD = "reward_fn"
#: grimoire-rl's tokenizer argument (Grimoire's methods use the trainer's tokenizer).
PEER_TOKENIZER = "tokenizer"
#: grimoire-rl's prompt columns (its ``tokenize_grpo``) -> Grimoire's.
PEER_PROMPT_COLUMNS = {
    "input_ids": "prompt_input_ids",
    "attention_mask": "prompt_attention_mask",
}


def is_peer_prompt_dataset(columns: Any) -> bool:
    """True for rows tokenized by grimoire-rl's ``tokenize_grpo``: its prompt columns, none of
    Grimoire's."""
    names = set(columns)
    return set(PEER_PROMPT_COLUMNS) <= names and not names & set(PEER_PROMPT_COLUMNS.values())


def peer_prompt_row(row: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """One grimoire-rl prompt row as Grimoire's: ``input_ids`` / ``attention_mask`` become
    ``prompt_input_ids`` / ``prompt_attention_mask``; without a ``prompt`` column the prompt text
    reward functions receive is decoded from the ids without special tokens (what grimoire-rl
    gave its reward functions). Metadata columns stay as they are."""
    out = {PEER_PROMPT_COLUMNS.get(k, k): v for k, v in row.items()}
    if "prompt" not in out:
        # batch_decode on a tensor, as grimoire-rl called it (a tokenizer written for it may
        # have only that)
        ids = torch.tensor([list(row["input_ids"])], dtype=torch.long)
        out["prompt"] = tokenizer.batch_decode(ids, skip_special_tokens=True)[0]
    return out


def peer_prompt_rows(dataset: Any, tokenizer: Any) -> Any:
    """``dataset`` with grimoire-rl's prompt columns read as Grimoire's (:func:`peer_prompt_row`),
    a ``datasets.Dataset`` or a list of row dicts; any other dataset is returned unchanged."""
    if dataset is None or not is_peer_prompt_dataset(columns_of(dataset)):
        return dataset
    if hasattr(dataset, "map") and hasattr(dataset, "column_names"):
        return dataset.map(
            lambda row: peer_prompt_row(row, tokenizer),
            remove_columns=list(PEER_PROMPT_COLUMNS),
            desc="grimoire-rl prompt columns",
        )
    return [peer_prompt_row(dict(row), tokenizer) for row in dataset]


def looks_like_tokenizer(value: Any) -> bool:
    """True for a tokenizer object (``encode`` and ``decode``), never for a number or a string."""
    if isinstance(value, bool | int | float | str | list | tuple | dict) or value is None:
        return False
    return callable(getattr(value, "encode", None)) and callable(getattr(value, "decode", None))


def peer_arguments(
    owner: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """``(args, kwargs, tokenizer)`` with grimoire-rl's spellings rewritten to Grimoire's.

    ``args`` excludes ``self``. Raises ``TypeError`` (what Python raises for a bad call) when the
    two spellings are mixed so that the intent is ambiguous.
    """
    kwargs = dict(kwargs)
    tokenizer = kwargs.pop(PEER_TOKENIZER, None)
    if PEER_REWARD in kwargs:
        if args or "reward_funcs" in kwargs:
            raise TypeError(
                f"{owner}: give the reward functions once, as reward_funcs (the first argument) "
                f"or as reward_fn= (grimoire-rl's name), not both"
            )
        args = (kwargs.pop(PEER_REWARD),)
    if len(args) >= 2 and looks_like_tokenizer(args[1]):
        if tokenizer is not None:
            raise TypeError(f"{owner}: the tokenizer is given twice (positionally and tokenizer=)")
        if len(args) > 2:
            raise TypeError(
                f"{owner}(reward_fn, tokenizer, ...): pass grimoire-rl's later arguments by "
                "keyword (num_generations=..., beta=...); their positions differ here, so a "
                "positional value would bind to another setting"
            )
        tokenizer, args = args[1], args[:1]
    return args, kwargs, tokenizer


def accepts_peer_spelling(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap an online method's ``__init__`` to accept grimoire-rl's spelling (module docstring).

    The tokenizer given that way is stored as ``self.peer_tokenizer`` after ``init`` ran (the
    outermost wrapper of a subclass chain sees it; the ``super().__init__`` calls inside get
    Grimoire's spelling only). A subclass whose own ``__init__`` takes a ``tokenizer`` or
    ``reward_fn`` parameter keeps it: those names are then left alone.
    """
    own = inspect.signature(init).parameters
    if PEER_TOKENIZER in own or PEER_REWARD in own:
        return init

    @functools.wraps(init)
    def init_with_peer_spelling(self: Any, *args: Any, **kwargs: Any) -> None:
        args, kwargs, tokenizer = peer_arguments(type(self).__name__, args, kwargs)
        init(self, *args, **kwargs)
        if tokenizer is not None:
            self.peer_tokenizer = tokenizer

    return init_with_peer_spelling


def _differences(given: Any, trainer: Any) -> list[str]:
    if type(given) is not type(trainer):
        return [f"type {type(given).__name__} vs {type(trainer).__name__}"]
    out = []
    for what, read in (
        ("vocabulary", lambda t: t.get_vocab()),
        ("special tokens", lambda t: t.special_tokens_map),
        ("chat template", lambda t: getattr(t, "chat_template", None)),
    ):
        try:
            if read(given) != read(trainer):
                out.append(what)
        except AttributeError:  # not a transformers tokenizer: compare what both have
            continue
    return out


def tokenizer_problem(owner: str, given: Any, trainer: Any) -> str | None:
    """Why ``given`` (grimoire-rl's ``tokenizer=``) cannot stand for the trainer's tokenizer, or
    None when it is the same object or an equal one (same type, vocabulary, special tokens and
    chat template: e.g. loaded twice from one folder)."""
    if given is None or given is trainer:
        return None
    diff = _differences(given, trainer)
    if not diff:
        return None
    return (
        f"{owner}(tokenizer=...) differs from the tokenizer given to GrimoireTrainer "
        f"({', '.join(diff)}): Grimoire's online methods sample, decode and score with the "
        "trainer's tokenizer. Pass the same tokenizer to both, or drop tokenizer= from the "
        "method (grimoire-rl's argument; not needed here)"
    )


__all__ = [
    "PEER_REWARD",
    "PEER_TOKENIZER",
    "accepts_peer_spelling",
    "looks_like_tokenizer",
    "peer_arguments",
    "tokenizer_problem",
]
