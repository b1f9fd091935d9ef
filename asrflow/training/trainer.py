"""Training: an explicit loop that calls components, each owning its policy, its timing and its state:
the data (``TrainData``), checkpoints (``CheckpointManager``: when to save, best, keep-last, rollback,
resume), validation (``Validator``), the non-finite guard, the run state (counters, plan position, loss
history, random state), the tracker (MLflow on rank 0) and observers, the one extension point.

The order inside a step makes resume exact: the stop flag is read right before the step's all-reduce,
no checkpoint is taken inside a non-finite streak, and MLflow is flushed only after the checkpoint is saved.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from asrflow.data.loading.workers import unpack_batch
from asrflow.logs import TerminalProgress
from asrflow.model.conformer_ctc import count_parameters
from asrflow.tracking.run import MlflowRun, NullTracker, start_training_run
from asrflow.training.config import TrainPaths
from asrflow.training.distributed import data_parallel, shutdown_distributed
from asrflow.training.final_model import write_final_model
from asrflow.training.init_model import apply_init
from asrflow.training.monitoring import StallWatchdog, report_step
from asrflow.training.nonfinite import RollbackNeeded
from asrflow.training.observers import ObservedRun, StopFlag, TrainObserver
from asrflow.training.outcome import Outcome, TrainOutcome, as_failure
from asrflow.training.parts import RunParts, RunPlace
from asrflow.training.precision import precision_change_tags
from asrflow.training.run_state import LossHistory, PlanPosition, RandomState, RunCounters
from asrflow.training.step import StepResult, apply_lr_scale, train_step

if TYPE_CHECKING:
    from asrflow.training.settings import TrainingSettings

logger = logging.getLogger(__name__)


class Trainer:
    """The loop of one training run over its built parts (:class:`~asrflow.training.parts.RunParts`): :meth:`run`
    trains (or resumes) and writes the model bundle.

    Build it with :func:`~asrflow.training.assemble.build_trainer`, which sets up the process, starts the
    process group and the tracking store, loads a start model, builds the parts and checks that every rank
    agrees. ``settings`` are the run's params (:class:`~asrflow.training.assemble.TrainingSettings`; the whole
    params are logged to MLflow); ``place`` its rank and device; ``tracking_uri`` the MLflow store (default:
    ``$MLFLOW_TRACKING_URI`` or ``sqlite:///mlflow.db``); ``observers``: :class:`~.observers.TrainObserver`.
    Constructing it has no side effect.
    """

    def __init__(
        self,
        settings: TrainingSettings,
        parts: RunParts,
        place: RunPlace,
        *,
        paths: TrainPaths,
        tracking_uri: str | None = None,
        observers: Sequence[TrainObserver] = (),
    ):
        self.config, self.run_config, self.features = settings.train, settings.run, settings.features
        self.seed, self.all_params, self.paths = settings.seed, settings.params, paths
        self.tracking_uri, self.observers = tracking_uri, list(observers)
        self.dist, self.device = place.dist, place.device
        self.data, self.model, self.init_model, self.frozen = parts.data, parts.model, parts.init_model, parts.frozen
        self.step_context, self.scheduler, self.guard = parts.step_context, parts.scheduler, parts.guard
        self.optimizer, self.scaler = self.step_context.optimizer, self.step_context.scaler
        self.precision = self.step_context.precision
        self.validator, self.checkpoints, self.train_params = parts.validator, parts.checkpoints, parts.train_params
        self.ddp_model: torch.nn.Module = self.model  # wrapped in DDP once the model is restored
        self.stop = StopFlag()
        self.tracker: MlflowRun | NullTracker = NullTracker()
        self.terminal_progress: TerminalProgress | None = None  # rank 0's, once the run starts
        self.counters, self.history = RunCounters(), LossHistory()
        self.position = PlanPosition(self.data.batches, self.dist.world_size)
        self.checkpoints.register(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler)
        self.checkpoints.register(scaler=self.scaler, rng=RandomState(), counters=self.counters)
        self.checkpoints.register(position=self.position, history=self.history, guard=self.guard)
        self.observed = ObservedRun(dist=self.dist, data=self.data, scaler=self.scaler, stop=self.stop)
        logger.info(
            f"model: {count_parameters(self.model)} parameters; {self.data.num_train} train / {self.data.num_dev} "
            f"dev utterances ({self.data.removed_for_ctc} removed as too short for CTC); precision "
            f"{self.precision.name} ({self.precision.reason}); device {self.device}; world size {self.dist.world_size}"
        )

    def request_stop(self) -> None:
        """Make the step in flight the last: it finishes, a checkpoint is saved, :meth:`run` returns STOPPED."""
        self.stop.request()

    def run(self) -> TrainOutcome:
        """Train to the end (resuming if checkpoints allow) and write the model bundle: FINISHED; or, after
        :meth:`request_stop`, end with the step in flight, checkpointed: STOPPED. Raises
        :class:`~asrflow.training.outcome.TrainingFailure` when the job around this process fails (another
        rank, a data worker) and :class:`~asrflow.errors.AsrflowError` for a mistake the user can fix."""
        status = "FAILED"
        try:
            loader = self._start_or_resume()
            self.ddp_model = data_parallel(self.model, self.dist, self.device)
            self.ddp_model.train()
            label = f"rank {self.dist.rank}: " if self.dist.enabled else ""  # labels its stack dumps
            with StallWatchdog(self.run_config.stall_timeout_s, label) as watchdog:
                finished = self._train_with_rollbacks(loader, watchdog)
            if finished:
                self._finish()
            status = "FINISHED" if finished else "KILLED"
            return TrainOutcome(Outcome.FINISHED if finished else Outcome.STOPPED, self._summary())
        except Exception as error:
            failure = as_failure(error, distributed=self.dist.enabled)
            if failure is None:
                raise
            raise failure from error
        finally:
            self.data.close()
            self.tracker.end(status)  # also flushes points past the last checkpoint: a resume skips them
            shutdown_distributed()

    def _train_with_rollbacks(self, loader: Iterator[dict], watchdog: StallWatchdog) -> bool:
        """Train until the last epoch ends (True) or a stop was requested (False), rolling back when told."""
        while True:
            try:
                return self._train(loader, watchdog)
            except RollbackNeeded:
                self._rollback()
                loader = self.data.open(self.position.epoch, self.position.step_in_epoch)

    def _train(self, loader: Iterator[dict], watchdog: StallWatchdog) -> bool:
        """The steps from the current position to the end of training (True) or a requested stop (False)."""
        accum_grad = self.config.optim.accum_grad
        while True:
            began = time.perf_counter()
            micro_batches = [unpack_batch(batch) for _, batch in zip(range(accum_grad), loader, strict=False)]
            if len(micro_batches) < accum_grad:
                return True
            waited = time.perf_counter() - began
            step = self.counters.global_step + 1
            result = train_step(
                self.ddp_model,
                micro_batches,
                self.step_context,
                step_tokens=micro_batches[0]["step_tokens"],
                stop_requested=functools.partial(self._stop_flag, step),
                frozen=self.frozen if step <= self.config.finetune.freeze_encoder_steps else (),
            )
            self.scheduler.step()
            watchdog.beat()
            item = micro_batches[0]["item"]
            elapsed = time.perf_counter() - began
            result = replace(result, step=step, elapsed_s=elapsed, data_wait_s=waited, cut_ids=item.step_cut_ids)
            self.counters.global_step = step
            self.position.advance(item)
            self.guard.observe(
                step, finite=result.finite, loss=result.loss, grad_norm=result.grad_norm, cut_ids=list(result.cut_ids)
            )
            self._report(result)
            for observer in self.observers:
                observer.after_step(self.observed, result)
            self._save(step, dev_loss=self._validate(step, watchdog), stop=result.stop)
            if result.stop:
                return False

    def _stop_flag(self, step: int) -> bool:
        """Read by :func:`train_step` right before its all-reduce: True makes the step in flight the last."""
        for observer in self.observers:
            observer.in_step(self.observed, step)
        return self.stop.requested

    def _report(self, result: StepResult) -> None:
        """The step's metrics to MLflow (rank 0), the loss history, and a log line now and then."""
        lr, epoch, skipped = self.optimizer.param_groups[0]["lr"], self.position.epoch, self.guard.total_skipped
        loss_scale = self.scaler.get_scale() if self.precision.uses_scaler else None
        context = dict(lr=lr, epoch=epoch, world_size=self.dist.world_size, skipped_total=skipped)
        metrics = report_step(self.tracker, self.history, result, loss_scale=loss_scale, **context)
        if self.terminal_progress is not None:
            self.terminal_progress.update(result.step, epoch, result.loss, metrics["train/audio_s_per_s"])

    def _validate(self, step: int, watchdog: StallWatchdog) -> float | None:
        """The dev loss when the validator measured one and it beats the best checkpoint's (every rank gets
        rank 0's verdict), else None."""
        loss = self.validator.maybe_validate(step, self.ddp_model, watchdog.beat)
        if loss is None:
            return None
        self.counters.last_dev_loss, self.counters.last_dev_step = loss, step
        self.tracker.record(step, {"dev/loss": loss})
        return loss if self.checkpoints.improved(loss) else None

    def _save(self, step: int, *, dev_loss: float | None = None, stop: bool = False, final: bool = False) -> None:
        """Checkpoint when one is due (every rank takes part), then send MLflow the points it covers."""
        in_streak = self.guard.consecutive > 0
        if self.checkpoints.save(step, dev_loss=dev_loss, in_streak=in_streak, stop=stop, final=final):
            self.tracker.flush()

    def _rollback(self) -> None:
        """Back to the newest good checkpoint with a lower learning rate; the run's guard totals are kept."""
        state, path = self.checkpoints.rollback_target()
        lr_scale = self.counters.lr_scale * self.config.nonfinite.rollback_lr_factor
        skipped, rollbacks = self.guard.total_skipped, self.guard.rollbacks
        self.tracker.discard_after(int(state["step"]))  # the abandoned steps are trained again
        self.checkpoints.restore(state)
        self.guard.rolled_back(skipped_before=skipped, rollbacks_before=rollbacks)
        self.counters.lr_scale = lr_scale
        apply_lr_scale(self.scheduler, lr_scale)
        logger.warning(
            f"rollback {self.guard.rollbacks} of at most {self.config.nonfinite.max_rollbacks}: back to {path} (step "
            f"{self.counters.global_step}), learning rate scaled to {lr_scale:.3g} x train.optim.lr"
        )

    def _start_or_resume(self) -> Iterator[dict]:
        """Rank 0 decides (fresh or resume) and the components are restored; the data loader opens at the
        position and is returned. MLflow (rank 0) opens in the background after the first step."""
        decision, state, path = self.checkpoints.resume(self.checkpoints.facts["fingerprint"], self.train_params)
        init_tags = {}
        if state is None and self.init_model is not None:  # a resumed run's weights are its checkpoint's
            init_tags = apply_init(self.model, self.init_model, self.data.tokenizer.pieces)
        if state is not None:
            self.checkpoints.restore(state)  # the tracker is not registered yet: it starts below
            position = self.position
            logger.info(
                f"resuming from {path}: step {self.counters.global_step}, epoch {position.epoch}, batch "
                f"{position.step_in_epoch} of the epoch"
            )
        for observer in self.observers:
            observer.on_start(self.observed)
        loader = self.data.open(self.position.epoch, self.position.step_in_epoch)
        if self.dist.is_main:  # names and tags the run, logs the datasets, starts MLflow's system metrics
            self.tracker = start_training_run(
                self.all_params,
                self.data.manifests,
                experiment=self.run_config.experiment,
                run_id=state["tracker"].get("run_id") if state else None,
                tracking_uri=self.tracking_uri,
            )
            total_steps = self.data.steps_per_epoch(0) * self.config.optim.epochs
            self.terminal_progress = TerminalProgress(total_steps=total_steps, start_step=self.counters.global_step)
        self.checkpoints.register(tracker=self.tracker)
        if state is None:
            logger.info("starting a fresh run")
            tags = {"precision": self.precision.name, "precision_reason": self.precision.reason, **init_tags}
            self.tracker.set_tags(tags)
            self._save(0)  # a rollback target, and the MLflow run id on disk
        else:
            self.tracker.load_state_dict(state["tracker"])
            self.tracker.set_tags(precision_change_tags(state["precision"], self.precision, self.counters.global_step))
        return loader

    def _finish(self) -> None:
        """The final checkpoint on every rank; rank 0 then writes the bundle, the loss plot and the artifacts."""
        self._save(self.counters.global_step, final=True)
        if self.dist.is_main:
            write_final_model(
                model=self.model,
                model_shape=self.model.shape,
                features=self.features,
                data=self.data,
                recent=self.checkpoints.late_checkpoints(self.counters.global_step, self.config.optim.average_last),
                precision=self.precision,
                history=self.history,
                summary=self._summary(),
                paths=self.paths,
                tracker=self.tracker,
                all_params=self.all_params,
                register_model_name=self.run_config.register_model_name,
            )

    def _summary(self) -> dict:
        return {
            "steps": self.counters.global_step,
            "epochs": self.config.optim.epochs,
            "best_dev_loss": self.checkpoints.best_dev_loss,
            "nonfinite_skipped": self.guard.total_skipped,
            "rollbacks": self.guard.rollbacks,
            "removed_for_ctc": self.data.removed_for_ctc,
            "precision": self.precision.name,
        }
