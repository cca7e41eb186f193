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

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from grimoire.batching.budget import TokenBudget
from grimoire.batching.loader import StepLoader
from grimoire.columns import pad_token_id_of
from grimoire.config.context import TrainingContext
from grimoire.config.training import TrainingConfig
from grimoire.contract.layout import to_device
from grimoire.forward.logprobs import release_buffers
from grimoire.losses.adapter import as_method
from grimoire.model.compiling import maybe_compile
from grimoire.model.prepare import resolve_checkpointing
from grimoire.normalise.reduction import StepReduction, WeightedMeans
from grimoire.normalise.units import backward_norm, loss_units
from grimoire.parallel.deepspeed import uses_deepspeed
from grimoire.parallel.fsdp import preemption_signals, release_process_group
from grimoire.training import checkpoint as ckpt
from grimoire.training import setup
from grimoire.training.callbacks import TrainerCallback
from grimoire.training.export import export_model, read_checkpoint_model, write_checkpoint_model
from grimoire.training.guard import NonFiniteGuard, apply_step
from grimoire.training.interrupts import on_signal
from grimoire.training.metrics import RunLog
from grimoire.training.report import write_run_summary
from grimoire.training.step import backward_micro_batches, finish_step, host_units


class GrimoireTrainer:
    """Train ``model`` with ``loss_fn`` on ``train_dataset`` (rows of token columns).

    Args:
        model: a transformers model (causal LM, or sequence classifier for reward modelling).
        tokenizer: its tokenizer (saved alongside checkpoints; pad id for collation).
        config: the :class:`TrainingConfig`.
        loss_fn: ``loss_fn(model, batch, training) -> (loss, metrics)`` with
            ``create_collator(pad_token_id)``; the contract: :mod:`grimoire.contract.method`.
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
        # The method's core first (no loss_weight: refused by name); capabilities get defaults.
        self.loss_fn = loss_fn = as_method(loss_fn)
        # The build steps of training/setup.py, in order; each names what it makes.
        self.config = config = setup.check_config(config)
        self.accelerator = acc = setup.build_accelerator(config)
        self.tokenizer = tokenizer
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset = tuple(
            loss_fn.adapt_rows(d, tokenizer) for d in (train_dataset, eval_dataset)
        )
        pad_id = pad_token_id_of(tokenizer, model)
        #: Whether micro-batches are packed rows (padding_free: auto / forced).
        self.packed = packed = setup.decide_packing(
            loss_fn, config, pad_id, data_collator, model, train_dataset, acc
        )
        setup.sequence_parallel(config, loss_fn, packed)  # sequence_parallel_size > 1 only
        #: Whether activations are checkpointed (gradient_checkpointing: auto / forced), and why.
        self.checkpointing = resolve_checkpointing(model, config, acc, loss_fn, train_dataset)
        model, self.step_hooks = setup.prepare_model(
            model, peft_config, config, acc, packed, checkpointing=self.checkpointing[0]
        )
        #: What torch_compile did (compiled blocks, or why eager); None when not asked.
        self.compile_state = maybe_compile(model, config)
        self.budget: TokenBudget | None = setup.build_budget(config, loss_fn, packed)
        setup.validate_data(loss_fn, model, config, self.budget, train_dataset, eval_dataset)
        #: The method reads the run through this context only.
        self.context: TrainingContext = setup.setup_method(
            loss_fn, config, acc, tokenizer, model, (train_dataset, eval_dataset), packed
        )
        self.collator = setup.build_collator(
            loss_fn, data_collator, packed, pad_id, config, acc.device.type
        )
        self.train_dataset, self.eval_dataset = setup.precompute_reference_columns(
            loss_fn, model, self.context, self.collator, self.budget
        )
        #: The rollout stage, for methods that generate (built from the method's parts).
        self.rollouts = setup.build_rollouts(loss_fn, self.context)
        setup.log_reference(loss_fn)
        plan = dict(grad_accum=config.gradient_accumulation_steps, seed=config.seed)
        self.loader = self._loader(
            self.train_dataset, config.batch_size, repeat=int(loss_fn.steps_per_batch), **plan
        )
        self.max_steps = config.max_steps or self.loader.steps_per_epoch * config.num_epochs
        model = setup.shard(model, config)
        self.model, self.optimizer, self.scheduler = setup.build_optimization(
            model, config, acc, self.max_steps
        )
        self.callbacks = setup.build_callbacks(callbacks, config)
        self._init_run_state()

    def _init_run_state(self) -> None:
        """The run's records, planner, evaluation loader and stop flags (what ``train()`` reads
        and writes)."""
        acc = self.accelerator
        self.planner = self.loader.planner
        self._eval_loader: StepLoader | None = None
        self.state = ckpt.TrainerState()
        #: How the run was launched, for the model card: the CLI sets {"command", "config"}.
        self.launch: dict[str, Any] | None = None
        self.records = RunLog(self.config, acc)  # metrics.jsonl + trackers
        self._reduction = StepReduction(acc, replicas=self.config.sequence_parallel_size)
        self.guard = NonFiniteGuard.for_run(self.config, acc, self.model)  # skips non-finite
        self._stop = self._stop_requested = False
        #: The signal that stopped the run with a checkpoint (preemption), else None.
        self.preempted_by: str | None = None
        self._signal: str | None = None
        # DeepSpeed steps its engine inside the last backward, before a post-hoc gradient rescale
        # could run: there the global loss units are summed before the backward passes instead.
        self._units_first = uses_deepspeed(acc)

    # ------------------------------------------------------------------ public API

    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def unwrapped_model(self) -> torch.nn.Module:
        return cast(torch.nn.Module, self.accelerator.unwrap_model(self.model))  # untyped upstream

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
        self.records.begin()
        with preemption_signals(cfg.checkpoint_signals, self._on_signal):
            self._train_loop()
        if self._signal is not None and self.accelerator.num_processes == 1:
            self.preempted_by = self._signal  # (several processes agree in the reduction)
        if self.guard.failure is not None:
            pass  # diverged: no checkpoint of it, no evaluation (raised below)
        elif self.preempted_by is not None:
            done = Path(cfg.output_dir) / f"{ckpt.PREFIX}{self.global_step}"
            path = done if done.is_dir() else self.save_checkpoint()
            if self.accelerator.is_main_process:
                ckpt.report_preemption(self.preempted_by, self.global_step, path)
        elif self.eval_dataset is not None and self._last_eval_step != self.global_step:
            self.evaluate()
        self.callbacks("on_train_end", self)
        self.records.end()
        write_run_summary(self, *started)
        release_buffers()  # the head's CPU logits buffer: not held past training
        self.guard.raise_if_failed()  # TrainingDiverged: no final model
        return self.state

    def _train_loop(self) -> None:
        cfg = self.config
        self.callbacks("on_train_begin", self)
        if cfg.eval_on_start and self.eval_dataset is not None:
            self.evaluate()
        self.model.train()
        self.records.open_window()
        self._last_eval_step = -1
        while not self._done():
            epoch = self.state.epoch
            self.callbacks("on_epoch_begin", self, epoch)
            start = self.state.step_in_epoch
            batches = self.loader.epoch(epoch, start, cfg.dataloader_num_workers)
            feed = self.rollouts.feed if self.rollouts else lambda b, *_: b  # async reads ahead
            for micro in feed(batches, self.global_step, start):
                self._optimizer_step(micro)
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
                if ckpt.at_epoch_end(cfg.save_on_epoch_end, ends_run=self._done()):
                    self.save_checkpoint()

    def _on_signal(self, name: str) -> None:
        """A checkpoint signal: stop at the next step boundary that every rank agrees on."""
        on_signal(name, self._signal, self.accelerator.is_main_process)  # 2nd Ctrl-C: abort
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
        for host, keep in self._eval_loader.all_batches():
            batch = self._to_device(host)
            with acc.autocast():
                if self.rollouts is not None:  # prompts: greedy samples, scored
                    loss, metrics = self.rollouts.evaluate(batch)
                else:
                    loss, metrics = self.loss_fn(self.model, batch, training=False)
            units = loss_units(self.loss_fn, host if self.rollouts is None else batch)
            means.add({"loss": loss, **metrics}, units * keep)
        self.model.train(was_training)
        result = {f"eval/{k}": v for k, v in means.compute(acc).items()}
        self.callbacks("on_evaluate", self, result)
        record = {"split": "eval", "step": self.global_step, "epoch": self._epoch_float()}
        self.records.write({**record, **result}, self.global_step)
        return result

    def close(self) -> None:
        """Wait for every rank, then destroy the group (an early exit can abort gloo); call it last."""
        self.accelerator.wait_for_everyone()
        if self.rollouts is not None:  # a sampler in process (vLLM) leaves the group as it was
            self.rollouts.close()
        # The DDP wrapper's reducer keeps the group alive until interpreter teardown, where
        # gloo's threads can abort the process: keep the plain model only, then release.
        self.model = self.unwrapped_model
        release_process_group(self.accelerator)

    def save_model(self, output_dir: str | Path, merge_adapter: bool = False) -> Path:
        """Write a loadable HF model (+ tokenizer). LoRA: the adapter, or merged weights if asked."""
        return export_model(self, Path(output_dir), merge_adapter)

    def save_checkpoint(self) -> Path:
        """Atomically write ``checkpoint-<step>`` with everything needed to resume exactly."""
        final = ckpt.save(
            Path(self.config.output_dir),
            self.global_step,
            self.accelerator,
            lambda folder: write_checkpoint_model(self, folder),
            self.scheduler,
            self.state,
            {"max_steps": self.max_steps},
            self.config.save_total_limit,
        )
        self.callbacks("on_save", self, str(final))
        return final

    # ------------------------------------------------------------------ the step

    def _optimizer_step(self, micro: list[tuple[dict[str, Any], float]]) -> None:
        """One optimizer step over this rank's micro-batches, as collated (on the host)."""
        acc, loss_fn, means = self.accelerator, self.loss_fn, WeightedMeans()
        ctx = self.context.step
        ctx.epoch, ctx.step_in_epoch = self.state.epoch, self.state.step_in_epoch
        ctx.global_step = self.global_step
        if self.rollouts is not None:  # sample + score, then the method builds training batches
            micro = [(self._to_device(b), keep) for b, keep in micro]
            micro, rollout_metrics, rollout_weight = self.rollouts.step(self.context, micro)
            means.add(rollout_metrics, rollout_weight)
        # Loss units and tokens counted before the batches move: on the host, no device read.
        weights, tokens = host_units(loss_fn, micro)
        micro = [(self._to_device(b), keep) for b, keep in micro]
        local = sum(weights)
        # Backward each micro-batch's mean loss x its loss units / norm (same on every rank, no
        # collective); the exact global normaliser is applied after the step's one reduction.
        norm = backward_norm(self.state.loss_units_seen, self.state.global_step, acc.num_processes)
        if self._units_first:
            norm = self.context.all_reduce_sum([local])[0] / acc.num_processes
        bad, checks = backward_micro_batches(acc, self.model, loss_fn, micro, weights, norm, means)
        flags = {"stop": float(self._stop_requested), "signal": float(self._signal is not None)}
        scalars = {"units": local, "tokens": tokens, "bad_loss": bad, **flags}
        # ONE read of the step's numbers (two with several processes): training/step.py.
        totals, self._step_metrics, self._last_grad_norm = finish_step(
            self.model,
            acc,
            self._reduction,
            scalars,
            means,
            norm=norm,
            rescale=not self._units_first,
            max_grad_norm=self.config.max_grad_norm,
            hooks=self.step_hooks,
            checks=checks,
        )
        if totals["stop"] > 0:
            self._stop = True
        if totals["signal"] > 0:  # some rank was signalled: all checkpoint before stopping
            self.preempted_by = self._signal or "a signal on another process"
        # Every rank reads the same totals, so every rank skips the same step.
        skip = self.guard.check(self.global_step + 1, totals, self._step_metrics.get("loss", 0.0))
        self._stop = self._stop or self.guard.failure is not None
        apply_step(skip, self.optimizer, self.scheduler, self.step_hooks)
        self.state.global_step += 1
        self.state.skipped_steps += int(skip)
        if not skip:  # a skipped step's NaN stays out of the logged window's mean
            self.records.add_step(self._step_metrics, totals["units"], totals["tokens"])
        self.state.loss_units_seen += totals["units"]
        self.state.tokens_seen += int(totals["tokens"])

    def _end_of_step(self) -> None:
        cfg, step = self.config, self.global_step
        metrics = dict(self._step_metrics)
        self.callbacks("on_step_end", self, step, metrics.pop("loss", float("nan")), metrics)
        if step % cfg.logging_steps == 0 or step == self.max_steps:
            self._log_train()
        if cfg.save_steps and step % cfg.save_steps == 0:
            self.save_checkpoint()

    def _log_train(self) -> None:
        progress = {
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": self._last_grad_norm,
            "tokens": self.state.tokens_seen,
            "loss_units": self.state.loss_units_seen,
            "skipped_steps": self.state.skipped_steps,
        }
        record = self.records.train_record(self.global_step, self._epoch_float(), progress)
        self.callbacks("on_log", self, record)
        self.records.write(record, self.global_step)

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
        acc, sp = self.accelerator, self.config.sequence_parallel_size
        return setup.build_loader(
            dataset, self.collator, self.budget, acc, batch_size, sp, **kwargs
        )

    def _to_device(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        return to_device(batch, self.accelerator.device)  # non-blocking copies

    def _maybe_resume(self) -> None:
        if not self.config.resume_from_checkpoint:
            return
        state = ckpt.resume_if_any(
            self.config.resume_from_checkpoint,
            self.config.output_dir,
            lambda folder: read_checkpoint_model(self, folder),
            self.scheduler,
            self.accelerator.process_index,
        )
        if state is not None:
            self.state.__dict__.update(vars(state))  # in place: callbacks may hold the object


__all__ = ["GrimoireTrainer"]
