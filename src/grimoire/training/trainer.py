"""``GrimoireTrainer``: the one training loop. Methods plug in through the loss protocol.

One optimizer step, top to bottom (docs/architecture.md names the module of each stage):
rows -> planner -> collator (:class:`~grimoire.batching.loader.StepLoader`, this rank's micro-batches
within the token budget) -> rollout (:class:`~grimoire.rollout.stage.RolloutStage`, only for
methods that generate) -> forward + loss (the method) -> backward of each micro-batch weighted
by its loss units -> normalise (ONE all-reduce of loss units, tokens, the stop flag and every
logged scalar; gradients rescaled by the global loss units) -> clip -> optimizer + scheduler ->
log / evaluate / checkpoint / stop. The loop never asks which method it is running.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from grimoire.batching.budget import TokenBudget
from grimoire.batching.loader import StepLoader, packing_decision
from grimoire.batching.validation import validate_training_data
from grimoire.config.context import TrainingContext
from grimoire.config.training import TrainingConfig
from grimoire.errors import ConfigError
from grimoire.forward.head_function import release_workspace
from grimoire.forward.precomputed import precompute_reference
from grimoire.model.compiling import maybe_compile
from grimoire.model.prepare import (
    check_world_size,
    configure_deepspeed,
    count_tokens,
    frozen_preparer,
    has_accelerator,
    pad_token_id_of,
    prepare_model,
    reset_accelerate_state,
    resolve_checkpointing,
    resolve_mixed_precision,
    save_hf,
)
from grimoire.optim.optimizers import (
    build_optimizer,
    build_scheduler,
    clip_gradients,
    scale_gradients,
)
from grimoire.parallel.fsdp import (
    gradient_sync,
    is_sharded,
    load_dcp,
    preemption_signals,
    release_process_group,
    save_dcp,
    shard_model,
)
from grimoire.training import checkpoint as ckpt
from grimoire.training.callbacks import CallbackList, ProgressCallback, TrainerCallback
from grimoire.training.metrics import (
    JsonlLogger,
    StepReduction,
    WeightedMeans,
    finish_trackers,
    init_trackers,
    peak_memory_mb,
)
from grimoire.training.report import note_saved_model, write_model_card, write_run_summary

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
        self.accelerator = acc = Accelerator(
            # On a machine with no accelerator, torchrun/accelerate-launched processes must be told
            # to form a CPU (gloo) group; otherwise each would silently train alone.
            cpu=not has_accelerator(),
            mixed_precision=resolve_mixed_precision(config),
            log_with=config.log_with,
            project_dir=config.output_dir,
        )
        check_world_size(acc.num_processes)
        set_seed(config.seed)
        self.tokenizer, self.loss_fn = tokenizer, loss_fn
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        pad_id = pad_token_id_of(tokenizer, model)
        #: Whether micro-batches are packed rows (padding_free: auto / forced), and why.
        packed, why = packing_decision(
            loss_fn, config, pad_id, data_collator, model, train_dataset, acc.device.type
        )
        self.packed = packed
        logger.info("micro-batches: %s (%s)", "packed rows" if packed else "padded", why)
        #: Whether activations are checkpointed (gradient_checkpointing: auto / forced), and why.
        self.checkpointing = resolve_checkpointing(model, config, acc, loss_fn, train_dataset)
        model, self.step_hooks = prepare_model(
            model, peft_config, config, acc, packed, checkpointing=self.checkpointing[0]
        )
        #: What torch_compile did (compiled blocks, or why eager); None when not asked.
        self.compile_state = maybe_compile(model, config)
        budget = config.max_tokens_per_device
        self.budget = (
            TokenBudget(budget, loss_fn, packed, config.truncate_long_samples) if budget else None
        )
        embeddings = getattr(model, "get_input_embeddings", lambda: None)()
        validate_training_data(
            loss_fn,
            {"train": train_dataset, "eval": eval_dataset},
            config.max_length,
            getattr(embeddings, "num_embeddings", None),
            self.budget,
        )
        # The method reads the run through this context only; set up before its collator exists
        # (KTO bounds its KL rows by max_length) and before DDP wraps the policy.
        self.context = TrainingContext(
            config, acc, tokenizer, model, train_dataset, eval_dataset, packed=packed
        )
        self.context.prepare_frozen = frozen_preparer(config, packed)
        if hasattr(loss_fn, "setup"):
            loss_fn.setup(self.context)
        self.collator = data_collator or (
            loss_fn.create_packed_collator(pad_id) if packed else loss_fn.create_collator(pad_id)
        )
        if config.precompute_ref_log_probs:
            # One no-grad reference pass now, batched as training will be; then the reference is
            # released and training reads the datasets' cached columns.
            train_dataset, eval_dataset = precompute_reference(
                loss_fn,
                model,
                (train_dataset, eval_dataset),
                collator=self.collator,
                budget=self.budget,
                batch_size=config.effective_eval_batch_size,
                accelerator=acc,
                move_policy=config.distributed != "fsdp2",
            )
            self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
            self.context.train_dataset, self.context.eval_dataset = train_dataset, eval_dataset
        #: The rollout stage, for methods that generate (they own it: engine, rewards).
        self.rollouts = loss_fn.rollouts if getattr(loss_fn, "needs_generation", False) else None
        if getattr(loss_fn, "needs_reference_model", False):
            source = getattr(getattr(loss_fn, "reference", None), "source", "the method's own")
            logger.info("%s: reference log-probs from %s", type(loss_fn).__name__, source)
        self.loader = self._loader(
            train_dataset,
            config.batch_size,
            grad_accum=config.gradient_accumulation_steps,
            seed=config.seed,
            repeat=int(getattr(loss_fn, "steps_per_batch", 1)),
        )
        self.planner = self.loader.planner
        self._eval_loader: StepLoader | None = None
        self.max_steps = config.max_steps or self.loader.steps_per_epoch * config.num_epochs
        if config.distributed == "fsdp2":
            # Sharded before the optimizer exists, so its state is sharded too; accelerate never
            # wraps a sharded model (on CPU its FSDP plugin would silently run DDP).
            model = shard_model(model, config)
        optimizer = build_optimizer(model, config)
        self.scheduler = build_scheduler(optimizer, config, self.max_steps)
        configure_deepspeed(acc, config)
        if is_sharded(model):
            self.model, self.optimizer = model, acc.prepare(optimizer)
        else:
            self.model, self.optimizer = acc.prepare(model, optimizer)

        self.state = ckpt.TrainerState()
        #: How the run was launched, for the model card: the CLI sets {"command", "config"}.
        self.launch: dict[str, Any] | None = None
        self.callbacks = CallbackList(
            # The progress bar goes last so its eval line shows metrics other callbacks add.
            list(callbacks or []) + ([ProgressCallback()] if config.progress_bar else [])
        )
        self.metrics_log = JsonlLogger(
            Path(config.output_dir) / "metrics.jsonl", acc.is_main_process
        )
        self._reduction = StepReduction(acc)
        self._stop = self._stop_requested = False
        #: The signal that stopped the run with a checkpoint (preemption), else None.
        self.preempted_by: str | None = None
        self._signal: str | None = None
        # DeepSpeed steps its engine inside the last backward, before a post-hoc gradient rescale
        # could run: there the global loss units are summed before the backward passes instead.
        self._units_first = getattr(acc.state, "deepspeed_plugin", None) is not None

    # ------------------------------------------------------------------ public API

    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def unwrapped_model(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)

    @property
    def stopped_early(self) -> bool:
        """True when a stop request (a callback's :meth:`request_stop`, or a checkpoint signal)
        ended the last :meth:`train` call; False when it ran to ``max_steps`` / ``max_tokens``."""
        return self._stop

    def request_stop(self) -> None:
        """Stop gracefully at a step boundary; any rank may ask, all ranks stop together.

        One process stops after the current step. Several processes agree in the next step's
        one all-reduce, so a request made after a step's reduction (e.g. in ``on_step_end`` or
        ``on_evaluate``) stops them all after the following step.
        """
        self._stop_requested = True
        if self.accelerator.num_processes == 1:
            self._stop = True

    def train(self) -> ckpt.TrainerState:
        """Run until ``max_steps`` (or ``num_epochs``), a stop request, or ``max_tokens``."""
        cfg = self.config
        self._maybe_resume()
        # For run_summary.json: this call's wall time and tokens (a resumed run started earlier).
        started = (time.time(), self.state.tokens_seen)
        if not cfg.resume_from_checkpoint:
            self.metrics_log.reset()  # a fresh run into an old output_dir starts a fresh log
        if cfg.log_with:
            init_trackers(self.accelerator, cfg)
        with preemption_signals(cfg.checkpoint_signals, self._on_signal):
            self._train_loop()
        if self._signal is not None and self.accelerator.num_processes == 1:
            self.preempted_by = self._signal  # (several processes agree in the reduction)
        if self.preempted_by is not None:
            done = Path(cfg.output_dir) / f"{ckpt.PREFIX}{self.global_step}"
            path = done if done.is_dir() else self.save_checkpoint()
            if self.accelerator.is_main_process:
                ckpt.report_preemption(self.preempted_by, self.global_step, path)
        elif self.eval_dataset is not None and self._last_eval_step != self.global_step:
            self.evaluate()
        self.callbacks("on_train_end", self)
        if cfg.log_with:
            finish_trackers(self.accelerator)  # (end_training would drop the process group)
        write_run_summary(self, *started)
        release_workspace()  # the head's CPU logits buffer: not held past training
        return self.state

    def _train_loop(self) -> None:
        cfg = self.config
        self.callbacks("on_train_begin", self)
        if cfg.eval_on_start and self.eval_dataset is not None:
            self.evaluate()
        self.model.train()
        self._window = {"tokens": 0.0, "time": time.time()}
        self._log_means = WeightedMeans()
        self._last_eval_step = -1
        while not self._done():
            epoch = self.state.epoch
            self.callbacks("on_epoch_begin", self, epoch)
            start = self.state.step_in_epoch
            for micro in self.loader.epoch(epoch, start, cfg.dataloader_num_workers):
                self._optimizer_step([(self._to_device(b), keep) for b, keep in micro])
                self.state.step_in_epoch += 1
                self._end_of_step()
                if cfg.eval_steps and self.global_step % cfg.eval_steps == 0:
                    self.evaluate()
                    self._last_eval_step = self.global_step
                if self._done():
                    break
            if self.state.step_in_epoch >= self.loader.steps_per_epoch:
                self.state.epoch, self.state.step_in_epoch = epoch + 1, 0
                self.callbacks("on_epoch_end", self, epoch)
                if cfg.save_on_epoch_end:
                    self.save_checkpoint()

    def _on_signal(self, name: str) -> None:
        """A checkpoint signal: stop at the next step boundary that every rank agrees on."""
        self._signal = name
        self.request_stop()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss and method metrics over ``eval_dataset`` (all ranks), plus callbacks' extras."""
        if self.eval_dataset is None:
            raise ValueError("evaluate() needs an eval_dataset")
        acc = self.accelerator
        if self._eval_loader is None:  # planned once: every evaluation walks the same batches
            self._eval_loader = self._loader(
                self.eval_dataset, self.config.effective_eval_batch_size, shuffle=False
            )
        was_training = self.model.training
        self.model.eval()
        means = WeightedMeans()
        for batch, keep in self._eval_loader.all_batches():
            batch = self._to_device(batch)
            with acc.autocast():
                loss, metrics = self.loss_fn(self.model, batch, training=False)
            means.add({"loss": loss, **metrics}, self._loss_units(batch) * keep)
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
        self.accelerator.wait_for_everyone()
        # The DDP wrapper's reducer keeps the group alive until interpreter teardown, where
        # gloo's threads can abort the process: keep the plain model only, then release.
        self.model = self.unwrapped_model
        release_process_group(self.accelerator)

    def save_model(self, output_dir: str | Path, merge_adapter: bool = False) -> Path:
        """Write a loadable HF model (+ tokenizer). LoRA: the adapter, or merged weights if asked."""
        out = Path(output_dir)
        save_hf(out, self.accelerator, self.model, self.tokenizer, self.step_hooks, merge_adapter)
        if self.accelerator.is_main_process:
            write_model_card(self, out)
            note_saved_model(self.config.output_dir, out)
        self.accelerator.wait_for_everyone()
        return out

    def save_checkpoint(self) -> Path:
        """Atomically write ``checkpoint-<step>`` with everything needed to resume exactly."""
        acc = self.accelerator

        def write_model(folder: Path) -> None:
            # The HF export is for people (from_pretrained); the DCP shards are for resuming,
            # on any number of processes.
            save_hf(folder, acc, self.model, self.tokenizer, self.step_hooks)
            write_model_card(self, folder)
            save_dcp(folder, self.model, self.optimizer)

        final = ckpt.save(
            Path(self.config.output_dir),
            self.global_step,
            acc,
            write_model,
            self.scheduler,
            self.state,
            {"max_steps": self.max_steps},
            self.config.save_total_limit,
        )
        self.callbacks("on_save", self, str(final))
        return final

    # ------------------------------------------------------------------ the step

    def _optimizer_step(self, micro: list[tuple[dict[str, Any], float]]) -> None:
        acc, loss_fn, means = self.accelerator, self.loss_fn, WeightedMeans()
        ctx = self.context.step
        ctx.epoch, ctx.step_in_epoch = self.state.epoch, self.state.step_in_epoch
        ctx.global_step = self.global_step
        if self.rollouts is not None:  # sample + score, then the method builds training batches
            micro, rollout_metrics, rollout_weight = self.rollouts.step(self.context, micro)
            means.add(rollout_metrics, rollout_weight)
        weights = [self._loss_units(b) * keep for b, keep in micro]
        local = sum(weights)
        # Backward each micro-batch's mean loss x its loss units / norm, where norm is the same
        # on every rank and survives a resume: the run's mean loss units per step and rank so far.
        # That keeps gradients at a mean's scale (no fp16 overflow) without a collective before
        # the backward passes; the exact global normaliser is applied to the gradients after the
        # step's one reduction below.
        seen, steps = self.state.loss_units_seen, self.state.global_step
        norm = seen / steps / acc.num_processes if steps and seen > 0 else 1.0
        if self._units_first:
            norm = self._sum_over_ranks(local) / acc.num_processes
        for i, ((batch, _), weight) in enumerate(zip(micro, weights)):
            last = i == len(micro) - 1
            sync = gradient_sync(acc, self.model, last)
            # DeepSpeed steps its engine inside backward() when gradients sync: only on the last.
            acc.gradient_state._set_sync_gradients(last)
            with sync, acc.autocast():
                loss, metrics = loss_fn(self.model, batch, training=True)
            acc.backward(loss * (weight / norm if norm > 0 else 0.0))
            means.add({"loss": loss, **metrics}, weight)
        tokens = sum(count_tokens(b) * keep for b, keep in micro)
        totals, self._step_metrics = self._reduction.reduce(
            {
                "units": local,
                "tokens": tokens,
                "stop": float(self._stop_requested),
                "signal": float(self._signal is not None),
            },
            means,
        )
        if totals["stop"] > 0:
            self._stop = True
        if totals["signal"] > 0:  # some rank was signalled: all checkpoint before stopping
            self.preempted_by = self._signal or "a signal on another process"
        if not self._units_first:
            # DDP averaged the ranks' gradients: (1/W) sum_r sum_i w_i grad_i / norm. Times
            # norm * W / U is the mean over every loss unit U of the global batch.
            units = totals["units"]
            scale_gradients(self.model, norm * acc.num_processes / units if units > 0 else 0.0)
        for hook in self.step_hooks:  # e.g. OSFT's gradient projection, before clipping
            hook.before_optimizer_step()
        self._last_grad_norm = clip_gradients(self.model, acc, self.config.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        for hook in self.step_hooks:
            hook.after_optimizer_step()
        self.state.global_step += 1
        self._log_means.add(self._step_metrics, totals["units"])
        self.state.loss_units_seen += totals["units"]
        self.state.tokens_seen += int(totals["tokens"])
        self._window["tokens"] += totals["tokens"]

    def _loss_units(self, batch: dict[str, Any]) -> float:
        """The method's loss units in ``batch`` (its ``loss_weight``); 1 per micro-batch for a
        plain callable without the hook."""
        weight_fn = getattr(self.loss_fn, "loss_weight", None)
        return float(weight_fn(batch)) if weight_fn is not None else 1.0

    def _sum_over_ranks(self, value: float) -> float:
        return self.context.all_reduce_sum([value])[0]

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
        # No collective here: a stop is agreed in the step's one reduction (see request_stop).
        max_tokens = self.config.max_tokens
        return (
            self._stop
            or self.global_step >= self.max_steps
            or (max_tokens is not None and self.state.tokens_seen >= max_tokens)
        )

    def _epoch_float(self) -> float:
        return self.state.epoch + self.state.step_in_epoch / self.loader.steps_per_epoch

    # ------------------------------------------------------------------ data

    def _loader(self, dataset: Any, batch_size: int, **kwargs: Any) -> StepLoader:
        acc = self.accelerator
        return StepLoader.build(
            dataset,
            self.collator,
            self.budget,
            batch_size=batch_size,
            world_size=acc.num_processes,
            rank=acc.process_index,
            **kwargs,
        )

    def _to_device(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        device = self.accelerator.device
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def _maybe_resume(self) -> None:
        if not self.config.resume_from_checkpoint:
            return
        state = ckpt.resume_if_any(
            self.config.resume_from_checkpoint,
            self.config.output_dir,
            lambda folder: load_dcp(folder, self.model, self.optimizer),
            self.scheduler,
            self.accelerator.process_index,
        )
        if state is not None:
            self.state.__dict__.update(vars(state))  # in place: callbacks may hold the object


__all__ = ["GrimoireTrainer"]
