"""``TrainingConfig``: every knob of the training loop, validated once at construction.

The YAML ``training:`` section maps onto this dataclass one-to-one (same names, same types); the
trainer reads it and never rewrites it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from grimoire.errors import ConfigError, did_you_mean

OPTIMIZERS = (
    "adamw",
    "adamw_torch",
    "adamw_hf",
    "adamw_8bit",
    "paged_adamw_8bit",
    "paged_adamw_32bit",
    "adafactor",
    "sgd",
    "muon",
)
LR_SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
MIXED_PRECISION = ("auto", "no", "fp16", "bf16")
TRACKERS = ("wandb", "tensorboard", "mlflow")
KBIT_UPCAST = ("all", "norms", "none")


@dataclass
class TrainingConfig:
    """Training-loop settings. Defaults follow the grimoire-rl README's configuration table, except
    where docs/migrating-from-grimoire-rl.md says otherwise (precision, packing, checkpointing)."""

    output_dir: str = "./output"
    num_epochs: int = 3
    max_steps: int | None = None
    batch_size: int = 4
    eval_batch_size: int | None = None
    gradient_accumulation_steps: int = 1
    learning_rate: float = 2e-5
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    warmup_steps: int = 0
    max_grad_norm: float | None = 1.0
    max_length: int = 2048
    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = "auto"  # auto: see precision.py
    # auto: off on a CPU when one micro-batch's activations fit in a quarter of the available
    # memory, else on (host_memory.py; decided and logged at start); true / false force it.
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    # glibc's mmap threshold fixed, so freed activations go back to the OS and resident memory
    # stays at the live peak, for more page faults (model/host_allocator.py); opt-in.
    return_freed_memory: bool = False
    optimizer: str = "adamw"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    # optimizer="muon": torch.optim.Muon on 2-D hidden weight matrices at this learning rate;
    # embeddings, the LM head, norms and biases stay on AdamW at learning_rate.
    muon_learning_rate: float = 0.02
    muon_momentum: float = 0.95
    lr_scheduler: str = "cosine"
    disable_dropout: bool = False
    logging_steps: int = 10
    eval_steps: int | None = None
    eval_on_start: bool = False
    save_steps: int | None = None
    save_total_limit: int | None = 2
    # A checkpoint (model + optimizer state: several times the model's size) after each complete
    # epoch. None (auto): after every epoch but one that ends the run, whose weights the final
    # model export holds (a checkpoint of the same step would only duplicate it, 4x larger);
    # True: after every epoch, the last included; False: never. save_steps and a checkpoint
    # signal (preemption) write theirs either way.
    save_on_epoch_end: bool | None = None
    resume_from_checkpoint: str | None = None
    seed: int = 42
    log_with: str | list[str] | None = None
    run_name: str | None = None
    # Trackers' project (wandb project, mlflow experiment, tensorboard sub-folder).
    project_name: str | None = None
    dataloader_num_workers: int = 0
    progress_bar: bool = True
    # Padding-free packing and token budgets (see docs/packing.md).
    # None (auto): packed whenever the method can pack and the model's attention keeps packed
    # samples apart (decided and logged at start; docs/packing.md); True / False force it.
    padding_free: bool | None = None
    # Padded micro-batches' width rounded up to a multiple of this (exact: extra padding), so a
    # run meets few shapes. None: 64 on a CUDA GPU, 1 (off) elsewhere.
    pad_to_multiple_of: int | None = None
    max_tokens_per_device: int | None = None
    max_tokens: int | None = None
    truncate_long_samples: bool = False
    # NEFTune (Jain et al., 2023): uniform noise on the input embeddings while training only.
    neftune_noise_alpha: float | None = None
    # grimoire-rl's name for neftune_noise_alpha (TRL's, above, is the one the run reads): moved
    # there at construction, then None, so a config holds the setting once.
    neftune_alpha: float | None = None
    # Quantized (k-bit) bases under LoRA, via peft's prepare_model_for_kbit_training: which
    # non-quantized layers are upcast to fp32, and its gradient checkpointing (None: follow
    # gradient_checkpointing).
    kbit_upcast: Literal["all", "norms", "none"] = "all"
    kbit_gradient_checkpointing: bool | None = None
    # DPO-family: one no-grad reference pass over the datasets before training; the columns are
    # cached and the reference model is not used again (TRL's name).
    precompute_ref_log_probs: bool = False
    # torch.compile the model (falls back to eager with a logged reason when it cannot).
    torch_compile: bool = False
    # Optional Liger kernels (GPU only).
    use_liger: bool = False
    # OSFT: orthogonal subspace fine-tuning (see docs/osft.md).
    osft: bool = False
    osft_unfreeze_rank_ratio: float = 0.25
    osft_target_modules: list[str] | None = None
    osft_train_non_targets: bool = False
    osft_upcast_dtype: Literal["float32", "float64"] = "float32"
    # Several processes (see docs/multi-gpu.md): "ddp" replicates the model on every process;
    # "fsdp2" shards parameters, gradients and optimizer state with torch's fully_shard.
    distributed: Literal["ddp", "fsdp2"] = "ddp"
    fsdp_reshard_after_forward: bool = True
    fsdp_cpu_offload: bool = False
    # Hybrid sharding (HSDP): shard within groups of this many consecutive ranks (GPUs per node,
    # so all-gathers stay on a node's fast links), replicate across the groups. None: shard over
    # every process (flat FSDP2). The world size must be a multiple (checked at start).
    fsdp_shard_group_size: int | None = None
    # Sequence parallelism (DeepSpeed-Ulysses, docs/multi-gpu.md): each packed row's tokens are
    # split over this many consecutive processes, attention exchanges heads for tokens. 1: off.
    sequence_parallel_size: int = 1
    # Signals that make every process checkpoint and stop at the next step boundary.
    checkpoint_signals: list[str] = dataclasses.field(default_factory=lambda: ["SIGTERM", "SIGINT"])
    # A step whose loss or gradient norm is not finite is skipped (no optimizer or scheduler
    # step); this many skipped steps in a row stop the run with an error and no final model.
    max_consecutive_skipped_steps: int = 3

    def __post_init__(self) -> None:
        problems = _type_problems(self)
        if not any(m.startswith("neftune_alpha ") for m in problems):
            problems += self._move_peer_names()
        # Value checks run on a copy where wrongly-typed fields hold their defaults, so one error
        # reports type and value problems together without tripping over a bad type.
        shadow = object.__new__(type(self))
        defaults = type(self)() if problems else None
        for f in dataclasses.fields(self):
            bad = any(msg.startswith(f"{f.name} ") for msg in problems)
            setattr(shadow, f.name, getattr(defaults if bad else self, f.name))
        problems += shadow._value_problems()
        if problems:
            raise ConfigError(problems, title="invalid TrainingConfig")

    @property
    def effective_eval_batch_size(self) -> int:
        return self.eval_batch_size or self.batch_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(
        cls,
        values: dict[str, Any],
        where: str = "training",
        hint: Callable[[str, Any, str], str | None] | None = None,
    ) -> TrainingConfig:
        """Build from a mapping, rejecting unknown keys with a "did you mean" hint.

        ``hint(key, value, where)`` may answer an unknown key first: the entry points pass
        :func:`grimoire.compat.trl_names.trl_hint`, which answers TRL's keys with ours (the config
        itself knows no other system's names).
        """
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [
            (hint and hint(k, v, where)) or f"{where}.{k}: unknown key{did_you_mean(k, names)}"
            for k, v in values.items()
            if k not in names
        ]
        if unknown:
            raise ConfigError(unknown, title="invalid TrainingConfig")
        return cls(**values)

    def _move_peer_names(self) -> list[str]:
        """grimoire-rl's ``neftune_alpha`` onto ``neftune_noise_alpha`` (a problem if both are
        given and differ)."""
        alias, value = self.neftune_alpha, self.neftune_noise_alpha
        if alias is None:
            return []
        if alias <= 0:
            return [f"neftune_alpha (neftune_noise_alpha's other name) must be > 0, got {alias}"]
        if value is not None and value != alias:
            return [
                f"neftune_alpha={alias} and neftune_noise_alpha={value} are the same setting "
                "(grimoire-rl's name and TRL's): give one"
            ]
        self.neftune_noise_alpha, self.neftune_alpha = alias, None
        return []

    def _value_problems(self) -> list[str]:
        return self._number_problems() + self._choice_problems() + self._parallel_problems()

    def _number_problems(self) -> list[str]:
        """Counts, step settings and optimizer numbers out of their range."""
        p: list[str] = []

        def positive(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if v is None or v <= 0:
                p.append(f"{name} must be > 0, got {v!r}")

        for name in ("num_epochs", "batch_size", "gradient_accumulation_steps", "max_length"):
            positive(name)
        for name in ("logging_steps",):
            positive(name)
        for name in (
            "max_steps",
            "eval_batch_size",
            "eval_steps",
            "save_steps",
            "save_total_limit",
            "max_tokens_per_device",
            "max_tokens",
            "pad_to_multiple_of",
        ):
            positive(name, allow_none=True)
        if self.learning_rate < 0:
            p.append(f"learning_rate must be >= 0, got {self.learning_rate}")
        if self.weight_decay < 0:
            p.append(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not 0.0 <= self.warmup_ratio <= 1.0:
            p.append(f"warmup_ratio must be in [0, 1], got {self.warmup_ratio}")
        if self.warmup_steps < 0:
            p.append(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            p.append(f"max_grad_norm must be > 0 or null (no clipping), got {self.max_grad_norm}")
        if self.max_consecutive_skipped_steps < 1:
            p.append(
                "max_consecutive_skipped_steps must be >= 1 (1: stop at the first non-finite "
                f"step), got {self.max_consecutive_skipped_steps}"
            )
        if self.dataloader_num_workers < 0:
            p.append(f"dataloader_num_workers must be >= 0, got {self.dataloader_num_workers}")
        if isinstance(self.gradient_checkpointing, str) and self.gradient_checkpointing != "auto":
            p.append(
                f"gradient_checkpointing must be true, false or 'auto', got "
                f"{self.gradient_checkpointing!r}"
            )
        return p

    def _choice_problems(self) -> list[str]:
        """Names outside their lists (precision, optimizer, scheduler, trackers, k-bit upcast)
        and the remaining optimizer, NEFTune and OSFT numbers."""
        p: list[str] = []
        for name, value, allowed in (
            ("mixed_precision", self.mixed_precision, MIXED_PRECISION),
            ("optimizer", self.optimizer, OPTIMIZERS),
            ("lr_scheduler", self.lr_scheduler, LR_SCHEDULERS),
        ):
            if value not in allowed:
                p.append(
                    f"{name}={value!r} is not one of {list(allowed)}{did_you_mean(value, allowed)}"
                )
        for tracker in [self.log_with] if isinstance(self.log_with, str) else self.log_with or []:
            if tracker not in TRACKERS:
                p.append(f"log_with={tracker!r} is not one of {list(TRACKERS)} (or null)")
        for name, (lo, hi) in {"adam_beta1": (0, 1), "adam_beta2": (0, 1)}.items():
            if not lo <= getattr(self, name) < hi:
                p.append(f"{name} must be in [{lo}, {hi}), got {getattr(self, name)}")
        for name in ("muon_learning_rate", "muon_momentum"):
            if getattr(self, name) <= 0:
                p.append(f"{name} must be > 0, got {getattr(self, name)}")
        if self.neftune_noise_alpha is not None and self.neftune_noise_alpha <= 0:
            p.append(
                f"neftune_noise_alpha must be > 0 or null (off), got {self.neftune_noise_alpha}"
            )
        if self.kbit_upcast not in KBIT_UPCAST:
            p.append(f"kbit_upcast must be one of {list(KBIT_UPCAST)}, got {self.kbit_upcast!r}")
        if self.adam_epsilon <= 0:
            p.append(f"adam_epsilon must be > 0, got {self.adam_epsilon}")
        if not 0.0 <= self.osft_unfreeze_rank_ratio <= 1.0:
            p.append(
                f"osft_unfreeze_rank_ratio must be in [0, 1], got {self.osft_unfreeze_rank_ratio}"
            )
        return p

    def _parallel_problems(self) -> list[str]:
        """Distribution (DDP / FSDP2 and its shard group), checkpoint signals, OSFT's dtype."""
        p: list[str] = []
        if self.distributed not in ("ddp", "fsdp2"):
            p.append(f"distributed must be 'ddp' or 'fsdp2', got {self.distributed!r}")
        if self.distributed == "fsdp2" and self.mixed_precision == "fp16":
            p.append(
                "distributed='fsdp2' runs bf16 (FSDP2's MixedPrecisionPolicy) or fp32: set "
                "mixed_precision to 'bf16' or 'no'"
            )
        if self.fsdp_shard_group_size is not None:
            if self.fsdp_shard_group_size <= 0:
                p.append(
                    f"fsdp_shard_group_size must be > 0 (e.g. the GPUs per node), or null to shard "
                    f"over every process; got {self.fsdp_shard_group_size}"
                )
            if self.distributed != "fsdp2":
                p.append(
                    f"fsdp_shard_group_size={self.fsdp_shard_group_size} is a setting of FSDP2 "
                    f"hybrid sharding: set distributed to 'fsdp2', or drop fsdp_shard_group_size"
                )
        import signal

        for name in self.checkpoint_signals:
            if not (isinstance(name, str) and name.startswith("SIG") and hasattr(signal, name)):
                p.append(f"checkpoint_signals: {name!r} is not a signal name (e.g. 'SIGTERM')")
            elif name in ("SIGKILL", "SIGSTOP"):
                p.append(f"checkpoint_signals: {name} cannot be caught")
        p += self._sequence_parallel_problems()
        if self.osft_upcast_dtype not in ("float32", "float64"):
            p.append(
                f"osft_upcast_dtype must be float32 or float64, got {self.osft_upcast_dtype!r}"
            )
        return p

    def _sequence_parallel_problems(self) -> list[str]:
        """``sequence_parallel_size``: >= 1, and the settings its first slice does not combine
        with (the world size, the model and the method are checked at start)."""
        n = self.sequence_parallel_size
        if n < 1:
            return [f"sequence_parallel_size must be >= 1 (1: off), got {n}"]
        if n == 1:
            return []
        off = {
            "fsdp_shard_group_size": (
                self.fsdp_shard_group_size is not None,
                "null: FSDP2 shards over the data ranks of the sequence-parallel mesh",
            ),
            "padding_free": (self.padding_free is False, "true or null: it splits packed rows"),
            "torch_compile": (self.torch_compile, "false: the split reads lengths on the host"),
            "use_liger": (self.use_liger, "false: Liger's head is not split"),
            "osft": (self.osft, "false (not checked with it yet)"),
        }
        return [
            f"sequence_parallel_size={n} needs {name} {need}"
            for name, (bad, need) in off.items()
            if bad
        ]


def _type_problems(cfg: Any) -> list[str]:
    hints = typing.get_type_hints(type(cfg))
    return [
        msg
        for f in dataclasses.fields(cfg)
        if (msg := check_type(f.name, getattr(cfg, f.name), hints[f.name])) is not None
    ]


def check_type(name: str, value: Any, hint: Any) -> str | None:
    """A message when ``value`` does not match the type ``hint`` (None when it does).

    Ints are accepted for float fields (YAML writes ``1`` for ``1.0``) but bools never pass as
    numbers, and numeric strings are rejected rather than silently converted.
    """
    if _matches(value, hint):
        return None
    shown = _type_name(hint)
    extra = ""
    if isinstance(value, str) and _looks_numeric(value):
        extra = " (a number written as a string; in YAML write e.g. 2.0e-5, not 2e-5 quoted)"
    return f"{name} must be {shown}, got {type(value).__name__} {value!r}{extra}"


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(hint))
    if origin is Literal:
        return isinstance(value, str)  # the value check names the allowed literals
    if hint is type(None):
        return value is None
    if origin in (list, tuple):
        (item,) = typing.get_args(hint)[:1] or (Any,)
        return isinstance(value, list | tuple) and all(_matches(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if origin is not None:
        return f"a {origin.__name__} of {_type_name(typing.get_args(hint)[0])}"
    return getattr(hint, "__name__", str(hint))


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


__all__ = ["LR_SCHEDULERS", "MIXED_PRECISION", "OPTIMIZERS", "TrainingConfig", "check_type"]
