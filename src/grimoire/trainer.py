"""``GrimoireTrainer``: the one training loop. Methods plug in through the loss protocol.

The loop, top to bottom: plan the step's micro-batches for this rank -> let the method add its
own phase (e.g. generation) -> weight every micro-batch by its loss units, summed over ranks ->
forward/backward each (gradient sync only on the last) -> clip -> optimizer + scheduler step ->
log / evaluate / checkpoint / stop. It never asks which method it is running.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from . import checkpoint as ckpt
from .callbacks import CallbackList, ProgressCallback, TrainerCallback
from .config import TrainingConfig
from .data.budget import TokenBudget
from .data.sampling import StepPlanner
from .data.validation import validate_token_columns
from .errors import ConfigError, DataError
from .metrics import JsonlLogger, WeightedMeans, peak_memory_mb, to_float
from .modeling import (
    configure_deepspeed,
    count_tokens,
    disable_dropout,
    enable_checkpointing,
    has_accelerator,
    pad_token_id_of,
    reset_accelerate_state,
)
from .optim import build_optimizer, build_scheduler

logger = logging.getLogger(__name__)


class GrimoireTrainer:
    """Train ``model`` with ``loss_fn`` on ``train_dataset`` (rows of token columns).

    Args:
        model: a transformers model (causal LM, or sequence classifier for reward modelling).
        tokenizer: its tokenizer (saved alongside checkpoints; pad id for collation).
        config: the :class:`TrainingConfig`.
        loss_fn: ``loss_fn(model, batch, training) -> (loss, metrics)`` with
            ``create_collator(pad_token_id)``; see :mod:`grimoire.losses.base` for optional hooks.
        train_dataset / eval_dataset: a ``datasets.Dataset`` or a list of dicts.
        data_collator: overrides ``loss_fn.create_collator``.
        peft_config: a peft ``LoraConfig`` to train adapters instead of the full model.
        callbacks: :class:`TrainerCallback` instances.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        config: TrainingConfig,
        loss_fn: Any,
        train_dataset: Any,
        eval_dataset: Any = None,
        data_collator: Any = None,
        peft_config: Any = None,
        callbacks: Sequence[TrainerCallback] | None = None,
    ):
        if not isinstance(config, TrainingConfig):
            raise ConfigError([f"config must be a TrainingConfig, got {type(config).__name__}"])
        self.config = config
        reset_accelerate_state()
        self.accelerator = Accelerator(
            # On a machine with no accelerator, torchrun/accelerate-launched processes must be told
            # to form a CPU (gloo) group; otherwise each would silently train alone.
            cpu=not has_accelerator(),
            mixed_precision=self._mixed_precision(config),
            log_with=config.log_with,
            project_dir=config.output_dir,
        )
        _check_world_size(self.accelerator.num_processes)
        set_seed(config.seed)
        self.tokenizer = tokenizer
        self.loss_fn = loss_fn
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.step_hooks: list[Any] = []  # objects with before/after_optimizer_step (e.g. OSFT)
        model = self._prepare_model(model, peft_config)
        pad_id = pad_token_id_of(tokenizer, model)
        self.collator, packed = self._make_collator(loss_fn, pad_id, data_collator)
        self.budget = (
            TokenBudget(config.max_tokens_per_device, loss_fn, packed, config.truncate_long_samples)
            if config.max_tokens_per_device
            else None
        )
        self._validate_data(model)

        self.planner = self._planner(
            train_dataset,
            config.batch_size,
            grad_accum=config.gradient_accumulation_steps,
            seed=config.seed,
            repeat=int(getattr(loss_fn, "steps_per_batch", 1)),
        )
        self.max_steps = config.max_steps or self.planner.steps_per_epoch * config.num_epochs
        optimizer = build_optimizer(model, config)
        self.scheduler = build_scheduler(optimizer, config, self.max_steps)
        configure_deepspeed(self.accelerator, config)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        if hasattr(loss_fn, "setup"):
            loss_fn.setup(self)

        self.state = ckpt.TrainerState()
        self.callbacks = CallbackList(
            # The progress bar goes last so its eval line shows metrics other callbacks add.
            list(callbacks or []) + ([ProgressCallback()] if config.progress_bar else [])
        )
        self.metrics_log = JsonlLogger(
            Path(config.output_dir) / "metrics.jsonl", self.accelerator.is_main_process
        )
        self._stop = False

    # ------------------------------------------------------------------ public API

    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def unwrapped_model(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)

    def request_stop(self) -> None:
        """Stop gracefully after the current step; any rank may ask, all ranks stop together."""
        self._stop = True
        self.accelerator.set_trigger()

    def train(self) -> ckpt.TrainerState:
        """Run until ``max_steps`` (or ``num_epochs``), a stop request, or ``max_tokens``."""
        cfg = self.config
        self._maybe_resume()
        if not cfg.resume_from_checkpoint:
            self.metrics_log.reset()  # a fresh run into an old output_dir starts a fresh log
        if cfg.log_with:
            # The tracker project comes from WANDB_PROJECT (the wandb convention); run_name names
            # the run inside it.
            init = {"wandb": {"name": cfg.run_name}} if cfg.run_name else {}
            self.accelerator.init_trackers(
                os.environ.get("WANDB_PROJECT", "grimoire"), config=cfg.to_dict(), init_kwargs=init
            )
        self.callbacks("on_train_begin", self)
        if cfg.eval_on_start and self.eval_dataset is not None:
            self.evaluate()
        self.model.train()
        self._window = {"tokens": 0.0, "time": time.time()}
        self._log_means = WeightedMeans()
        last_eval_step = -1
        while not self._done():
            epoch = self.state.epoch
            self.callbacks("on_epoch_begin", self, epoch)
            for step_batches in self._step_batches(epoch, self.state.step_in_epoch):
                self._optimizer_step(step_batches)
                self.state.step_in_epoch += 1
                self._end_of_step()
                if cfg.eval_steps and self.global_step % cfg.eval_steps == 0:
                    self.evaluate()
                    last_eval_step = self.global_step
                if self._done():
                    break
            if self.state.step_in_epoch >= self.planner.steps_per_epoch:
                self.state.epoch, self.state.step_in_epoch = epoch + 1, 0
                self.callbacks("on_epoch_end", self, epoch)
                if cfg.save_on_epoch_end:
                    self.save_checkpoint()
        if self.eval_dataset is not None and last_eval_step != self.global_step:
            self.evaluate()
        self.callbacks("on_train_end", self)
        if cfg.log_with:
            self.accelerator.end_training()
        return self.state

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss and method metrics over ``eval_dataset`` (all ranks), plus callbacks' extras."""
        if self.eval_dataset is None:
            raise ValueError("evaluate() needs an eval_dataset")
        acc = self.accelerator
        planner = self._planner(
            self.eval_dataset, self.config.effective_eval_batch_size, shuffle=False
        )
        was_training = self.model.training
        self.model.eval()
        means = WeightedMeans()
        for step in range(planner.steps_per_epoch):
            for indices in planner.plan(0, step):
                batch, weight = self._collate(self.eval_dataset, indices or [0], bool(indices))
                batch = self._to_device(batch)
                with acc.autocast():
                    loss, metrics = self.loss_fn(self.model, batch, training=False)
                means.add({"loss": loss, **metrics}, self._loss_units(batch) * weight)
        self.model.train(was_training)
        result = {f"eval/{k}": v for k, v in means.compute(acc).items()}
        self.callbacks("on_evaluate", self, result)
        self._record(
            {"split": "eval", "step": self.global_step, "epoch": self._epoch_float(), **result}
        )
        return result

    def close(self) -> None:
        """End a multi-process run cleanly: wait for every rank, then destroy the process group.

        A rank that exits while its peers still use the group can abort in the collective
        library's background threads (seen with gloo); scripts launched with torchrun or
        ``accelerate launch`` should call this last.
        """
        import gc

        import torch.distributed as dist

        self.accelerator.wait_for_everyone()
        if dist.is_available() and dist.is_initialized():
            # destroy_process_group only drops c10d's own references; the DDP wrapper's reducer
            # (and accelerate's list of prepared objects) keep the group alive until interpreter
            # teardown, where gloo's threads can abort the process. Keep the plain model only.
            self.model = self.unwrapped_model
            self.accelerator.free_memory()
            gc.collect()
            dist.destroy_process_group()

    def save_model(self, output_dir: str | Path, merge_adapter: bool = False) -> Path:
        """Write a loadable HF model (+ tokenizer). LoRA: the adapter, or merged weights if asked."""
        out = Path(output_dir)
        self._save_hf(out, merge_adapter=merge_adapter)
        self.accelerator.wait_for_everyone()
        return out

    def save_checkpoint(self) -> Path:
        """Atomically write ``checkpoint-<step>`` with everything needed to resume exactly."""
        acc = self.accelerator
        root = Path(self.config.output_dir)
        tmp, final = ckpt.begin(root, self.global_step)
        if acc.is_main_process:
            if tmp.exists():
                import shutil

                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        self._save_hf(tmp, for_resume=True)
        if acc.is_main_process:
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save(self.scheduler.state_dict(), tmp / "scheduler.pt")
            ckpt.write_state(tmp, self.state, {"max_steps": self.max_steps})
        torch.save(ckpt.rng_state(), tmp / f"rng_state_{acc.process_index}.pt")
        acc.wait_for_everyone()
        if acc.is_main_process:
            ckpt.commit(tmp, final)
            ckpt.rotate(root, self.config.save_total_limit)
        acc.wait_for_everyone()
        self.callbacks("on_save", self, str(final))
        return final

    # ------------------------------------------------------------------ the step

    def _optimizer_step(self, micro: list[tuple[dict[str, Any], float]]) -> None:
        acc, loss_fn = self.accelerator, self.loss_fn
        if hasattr(loss_fn, "prepare_step"):
            micro = _rezip(loss_fn.prepare_step(self, [b for b, _ in micro]), micro)
        weights = [self._loss_units(b) * keep for b, keep in micro]
        # Normalise by the loss units of the whole global step (all micro-batches, all ranks):
        # DDP averages gradients over ranks, hence the world-size factor.
        total = self._sum_over_ranks(sum(weights))
        tokens = sum(count_tokens(b) * keep for b, keep in micro)
        step_means = WeightedMeans()
        for i, ((batch, _), weight) in enumerate(zip(micro, weights)):
            last = i == len(micro) - 1
            sync = contextlib.nullcontext() if last else acc.no_sync(self.model)
            # DeepSpeed steps its engine inside backward() when gradients sync: only on the last.
            acc.gradient_state._set_sync_gradients(last)
            with sync, acc.autocast():
                loss, metrics = loss_fn(self.model, batch, training=True)
            scale = weight / total * acc.num_processes if total > 0 else 0.0
            acc.backward(loss * scale)
            if weight > 0:
                step_means.add({"loss": loss, **metrics}, weight)
        for hook in self.step_hooks:  # e.g. OSFT's gradient projection, before clipping
            hook.before_optimizer_step()
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        for hook in self.step_hooks:
            hook.after_optimizer_step()
        self.state.global_step += 1
        # One small all-reduce per step: callbacks and the log see global (all-rank) values.
        self._step_metrics = step_means.compute(acc)
        self._log_means.add(self._step_metrics, total)
        self.state.loss_units_seen += total
        step_tokens = self._sum_over_ranks(tokens)
        self.state.tokens_seen += int(step_tokens)
        self._window["tokens"] += step_tokens
        self._last_grad_norm = grad_norm

    def _loss_units(self, batch: dict[str, Any]) -> float:
        """The method's loss units in ``batch`` (its ``loss_weight``); 1 per micro-batch for a
        plain callable without the hook."""
        weight_fn = getattr(self.loss_fn, "loss_weight", None)
        return float(weight_fn(batch)) if weight_fn is not None else 1.0

    def _clip_gradients(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.config.max_grad_norm
        norm = self.accelerator.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
        return to_float(norm) if norm is not None else float("nan")

    def _end_of_step(self) -> None:
        cfg, step = self.config, self.global_step
        metrics = dict(self._step_metrics)
        self.callbacks("on_step_end", self, step, metrics.pop("loss", float("nan")), metrics)
        if step % cfg.logging_steps == 0 or step == self.max_steps:
            self._log_train()
        if cfg.save_steps and step % cfg.save_steps == 0:
            self.save_checkpoint()

    def _log_train(self) -> None:
        now = time.time()
        elapsed = max(now - self._window["time"], 1e-9)
        metrics = self._log_means.compute(self.accelerator, reduce=False)  # already global
        record = {
            "split": "train",
            "step": self.global_step,
            "epoch": self._epoch_float(),
            "loss": metrics.pop("loss", float("nan")),
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": self._last_grad_norm,
            "tokens": self.state.tokens_seen,
            "loss_units": self.state.loss_units_seen,
            "tokens_per_sec": self._window["tokens"] / elapsed,
            "elapsed": now - self.metrics_log.start,
            "peak_memory_mb": peak_memory_mb(),
            **metrics,
        }
        self._window = {"tokens": 0.0, "time": now}
        self.callbacks("on_log", self, record)
        self._record(record)

    def _record(self, record: dict[str, Any]) -> None:
        self.metrics_log.write(record)
        if self.config.log_with:
            numeric = {k: v for k, v in record.items() if isinstance(v, int | float)}
            self.accelerator.log(numeric, step=self.global_step)

    def _done(self) -> bool:
        # Every rank calls this at the same points, so the trigger's all-reduce stays matched; a
        # stop requested by any rank (even from on_evaluate) stops them all here.
        if self.accelerator.check_trigger():
            self._stop = True
        max_tokens = self.config.max_tokens
        return (
            self._stop
            or self.global_step >= self.max_steps
            or (max_tokens is not None and self.state.tokens_seen >= max_tokens)
        )

    def _epoch_float(self) -> float:
        return self.state.epoch + self.state.step_in_epoch / self.planner.steps_per_epoch

    def _sum_over_ranks(self, value: float) -> float:
        if self.accelerator.num_processes == 1:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.accelerator.device)
        return float(self.accelerator.reduce(t, reduction="sum")[0])

    # ------------------------------------------------------------------ data

    def _planner(self, dataset: Any, batch_size: int, **kwargs: Any) -> StepPlanner:
        """Plan ``dataset``'s micro-batches for this rank, within the token budget if set."""
        acc, budget = self.accelerator, self.budget
        return StepPlanner(
            num_samples=len(dataset),
            batch_size=batch_size,
            world_size=acc.num_processes,
            rank=acc.process_index,
            lengths=budget.costs(dataset) if budget else None,
            max_tokens_per_device=budget.max_tokens if budget else None,
            padded=bool(budget and not budget.packed),
            **kwargs,
        )

    def _step_batches(self, epoch: int, start_step: int):
        """Yield each remaining step's micro-batches as ``(batch_on_device, keep)`` pairs.

        Workers (``dataloader_num_workers``) only collate, on CPU; tensors are moved to the
        device here in the main process (a worker touching CUDA fails).
        """
        steps = _StepDataset(self, epoch, start_step)
        workers = self.config.dataloader_num_workers
        items: Any = (steps[i] for i in range(len(steps)))
        if workers > 0:
            items = torch.utils.data.DataLoader(
                steps, batch_size=None, num_workers=workers, collate_fn=lambda x: x
            )
        for item in items:
            yield [(self._to_device(b), keep) for b, keep in item]

    def _collate(self, dataset: Any, indices: list[int], real: bool) -> tuple[dict, float]:
        """One micro-batch on CPU and its keep flag (0.0 for a rank-sync dummy)."""
        rows = [dataset[int(i)] for i in indices]
        if self.budget is not None:
            rows = [self.budget.fit(r) for r in rows]
        return self.collator(rows), 1.0 if real else 0.0

    def _to_device(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        device = self.accelerator.device
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def _make_collator(self, loss_fn: Any, pad_id: int, given: Any) -> tuple[Any, bool]:
        """``(collator, packed)``: packed rows whenever padding-free or a token budget is asked
        for and the method can pack; a budget with a method that cannot pack (reward modelling)
        bins padded micro-batches instead. A user's ``data_collator`` is taken as padded unless
        it says otherwise (``packed = True`` attribute)."""
        cfg = self.config
        if given is not None:
            return given, bool(getattr(given, "packed", False))
        if not (cfg.padding_free or cfg.max_tokens_per_device):
            return loss_fn.create_collator(pad_id), False
        packed = getattr(loss_fn, "create_packed_collator", lambda _: None)(pad_id)
        if packed is not None:
            return packed, True
        if cfg.padding_free:
            raise ConfigError(
                [
                    f"{type(loss_fn).__name__} does not support padding-free batches: unset "
                    "training.padding_free (training.max_tokens_per_device alone still bounds "
                    "its padded micro-batches)"
                ]
            )
        return loss_fn.create_collator(pad_id), False

    def _validate_data(self, model: torch.nn.Module) -> None:
        cfg = self.config
        vocab = (
            model.get_input_embeddings().num_embeddings
            if hasattr(model, "get_input_embeddings")
            else None
        )
        problems: list[str] = []
        for split, ds in (("train", self.train_dataset), ("eval", self.eval_dataset)):
            if ds is None:
                continue
            if len(ds) == 0:
                problems.append(f"{split} dataset is empty")
                continue
            if hasattr(self.loss_fn, "validate_dataset"):
                problems += self.loss_fn.validate_dataset(ds, split)
            problems += validate_token_columns(
                ds, split, max_length=cfg.max_length, vocab_size=vocab
            )
        if self.budget is not None and not problems:
            for split, ds in (("train", self.train_dataset), ("eval", self.eval_dataset)):
                if ds is not None:
                    problems += self.budget.problems(ds, split)
        if problems:
            raise DataError(problems, title="invalid training data (nothing was trained)")

    # ------------------------------------------------------------------ model set-up and saving

    @staticmethod
    def _mixed_precision(config: TrainingConfig) -> str:
        if config.mixed_precision == "fp16" and not torch.cuda.is_available():
            raise ConfigError(
                [
                    "mixed_precision='fp16' needs a CUDA GPU; on CPU use 'bf16' (fast with AMX) or 'no'"
                ]
            )
        return config.mixed_precision

    def _prepare_model(self, model: torch.nn.Module, peft_config: Any) -> torch.nn.Module:
        cfg = self.config
        quantized = bool(
            getattr(model, "is_quantized", False) or getattr(model, "hf_quantizer", None)
        )
        if quantized and peft_config is None:
            raise ConfigError(["a quantized model can only be trained with LoRA: pass peft_config"])
        if cfg.osft and peft_config is not None:
            raise ConfigError(
                ["OSFT and LoRA cannot be combined: drop peft_config or set osft=False"]
            )
        if cfg.use_liger:
            from .kernels import apply_liger

            apply_liger(model)
        if peft_config is not None:
            from peft import get_peft_model, prepare_model_for_kbit_training

            if quantized:
                model = prepare_model_for_kbit_training(
                    model,
                    use_gradient_checkpointing=cfg.gradient_checkpointing,
                    gradient_checkpointing_kwargs={"use_reentrant": False},
                )
            model = get_peft_model(model, peft_config)
        if cfg.gradient_checkpointing:
            enable_checkpointing(model)
        if getattr(model, "config", None) is not None and hasattr(model.config, "use_cache"):
            model.config.use_cache = False
        if cfg.disable_dropout:
            disable_dropout(model)
        if cfg.osft:
            from .osft import attach_osft

            self.step_hooks.append(attach_osft(model, cfg, self.accelerator))
        return model

    def _save_hf(self, out: Path, merge_adapter: bool = False, for_resume: bool = False) -> None:
        acc = self.accelerator
        state_dict = acc.get_state_dict(self.model)  # gathers FSDP / ZeRO-3 shards
        if not acc.is_main_process:
            return
        out.mkdir(parents=True, exist_ok=True)
        model = self.unwrapped_model
        for hook in self.step_hooks:
            # A hook that reparametrises weights (OSFT) exports dense HF weights, and keeps its
            # own factors beside them so a resume restores them exactly.
            if hasattr(hook, "export_state_dict"):
                state_dict = hook.export_state_dict(state_dict)
            if for_resume and hasattr(hook, "save_extra"):
                hook.save_extra(out)
        if merge_adapter and hasattr(model, "merge_and_unload"):
            copy.deepcopy(model).merge_and_unload().save_pretrained(out, safe_serialization=True)
        else:
            model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
        if self.tokenizer is not None and hasattr(self.tokenizer, "save_pretrained"):
            self.tokenizer.save_pretrained(out)

    def _maybe_resume(self) -> None:
        spec = self.config.resume_from_checkpoint
        if not spec:
            return
        path = ckpt.resolve_resume_path(spec, self.config.output_dir)
        if path is None:
            logger.info("resume_from_checkpoint='latest' but no checkpoint yet: starting fresh")
            return
        extra_loaders = [h for h in self.step_hooks if hasattr(h, "load_extra")]
        if extra_loaders:  # the hook restores the (reparametrised) weights itself
            for hook in extra_loaders:
                hook.load_extra(self.unwrapped_model, path)
        else:
            ckpt.load_model_weights(self.unwrapped_model, path)
        self.optimizer.load_state_dict(ckpt.torch_load(path / "optimizer.pt"))
        self.scheduler.load_state_dict(ckpt.torch_load(path / "scheduler.pt"))
        self.state = ckpt.read_state(path)
        rng_file = path / f"rng_state_{self.accelerator.process_index}.pt"
        if rng_file.exists():
            ckpt.set_rng_state(ckpt.torch_load(rng_file))
        logger.info("resumed from %s at step %d", path, self.state.global_step)


class _StepDataset(torch.utils.data.Dataset):
    """Map-style view of one epoch's remaining steps, so a DataLoader can prefetch them."""

    def __init__(self, trainer: GrimoireTrainer, epoch: int, start_step: int):
        self.trainer, self.epoch, self.start = trainer, epoch, start_step
        self.steps = trainer.planner.steps_per_epoch

    def __len__(self) -> int:
        return max(0, self.steps - self.start)

    def __getitem__(self, i: int) -> list[tuple[dict[str, Any], float]]:
        t = self.trainer
        plan = t.planner.plan(self.epoch, self.start + i)
        fallback = next((m for m in plan if m), None) or [
            int(t.planner.step_indices(self.epoch, 0)[0])
        ]
        return [t._collate(t.train_dataset, m or fallback[:1], bool(m)) for m in plan]


def _rezip(batches: list[dict], micro: list[tuple[dict, float]]) -> list[tuple[dict, float]]:
    """Keep dummy flags aligned after a method's ``prepare_step`` (which may change the count)."""
    if len(batches) == len(micro):
        return [(b, keep) for b, (_, keep) in zip(batches, micro)]
    return [(b, 1.0) for b in batches]


def _check_world_size(num_processes: int) -> None:
    """Refuse to train alone when the launcher started several processes.

    accelerate's process state is a per-process singleton: if something built it before the
    trainer (e.g. ``PartialState()`` with its default ``cpu=False`` on a CPU-only machine), every
    torchrun worker would run the whole job by itself and they would overwrite each other's files.
    """
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and num_processes != launched:
        raise RuntimeError(
            f"the launcher started {launched} processes (WORLD_SIZE) but accelerate sees "
            f"{num_processes}; accelerate's process state was created before GrimoireTrainer "
            "with different settings. On a machine without a GPU create it as "
            "PartialState(cpu=True), or let GrimoireTrainer create it first."
        )


__all__ = ["GrimoireTrainer"]
