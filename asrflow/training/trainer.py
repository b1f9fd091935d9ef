"""Training: an explicit loop that calls components, each owning its policy and its state.

* :class:`~asrflow.training.train_data.TrainData`: tokenizer, CMVN, batch plan, datasets, loader;
* :class:`~asrflow.training.checkpoint_manager.CheckpointManager`: when to save, best, keep-last,
  rollback target, resume decision; a checkpoint is the dict of the registered components' states;
* :class:`~asrflow.training.nonfinite.NonFiniteGuard`: skipped steps, rollbacks;
* :mod:`~asrflow.training.run_state`: step count, plan position, loss history, random state;
* the tracker (MLflow on rank 0, :class:`~asrflow.tracking.tracker.NullTracker` elsewhere);
* observers (:mod:`asrflow.training.observers`): the one extension point.

The order inside a step is what makes resume exact: the stop flag is read right before the
step's all-reduce, no checkpoint is taken inside a non-finite streak, and MLflow is flushed
only after the checkpoint is on disk.
"""

from __future__ import annotations

import functools
import logging
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, replace

import torch
from torch.nn.parallel import DistributedDataParallel

from asrflow.code_digest import source_digest
from asrflow.data.features import FeatureConfig
from asrflow.data.workers import unpack_batch
from asrflow.logs import TerminalProgress
from asrflow.model.conformer_ctc import build_model, count_parameters
from asrflow.params import flatten
from asrflow.tracking.background import BackgroundTracker
from asrflow.tracking.tracker import NullTracker
from asrflow.training.checkpoint import content_digest
from asrflow.training.checkpoint_manager import CheckpointManager
from asrflow.training.config import TrainConfig, TrainPaths
from asrflow.training.distributed import DistInfo, check_same_everywhere, init_distributed, shutdown_distributed
from asrflow.training.failures import describe_failure
from asrflow.training.final_model import write_final_model
from asrflow.training.monitoring import StallWatchdog, report_step, step_metrics
from asrflow.training.nonfinite import NonFiniteGuard, RollbackNeeded
from asrflow.training.observers import TrainObserver
from asrflow.training.precision import (
    device_capability,
    native_bf16_cpu_flags,
    precision_change_tags,
    resolve_precision,
)
from asrflow.training.resume import build_fingerprint, training_params
from asrflow.training.run_state import LossHistory, PlanPosition, RandomState, RunCounters, seed_everything
from asrflow.training.step import StepResult, apply_lr_scale, build_optimizer, build_scheduler, train_step
from asrflow.training.train_data import TrainData

logger = logging.getLogger(__name__)

#: Exit code after SIGTERM/SIGINT: the step finished, a checkpoint was saved; run again to resume.
EXIT_INTERRUPTED = 75


class Trainer:
    """Runs (or resumes) one training run described by ``config`` and writes the model bundle.

    Args:
        config, features: the ``train:`` and ``features:`` params.
        seed: the run's seed (params ``seed``).
        all_params: every param, logged to MLflow as the run's params.
        paths: inputs and outputs (see :class:`~asrflow.training.config.TrainPaths`).
        tracking_uri: MLflow store (default: ``$MLFLOW_TRACKING_URI`` or ``sqlite:///mlflow.db``).
        observers: see :class:`~asrflow.training.observers.TrainObserver`.
    """

    def __init__(
        self,
        config: TrainConfig,
        features: FeatureConfig,
        *,
        seed: int,
        all_params: dict | None = None,
        paths: TrainPaths | None = None,
        tracking_uri: str | None = None,
        observers: Sequence[TrainObserver] = (),
    ):
        self.config = config
        self.features = features
        self.seed = seed
        self.all_params = all_params or {}
        self.paths = paths or TrainPaths()
        self.tracking_uri = tracking_uri
        self.observers = list(observers)
        self.tracker: BackgroundTracker | NullTracker = NullTracker()
        self.terminal_progress: TerminalProgress | None = None
        self.stop_requested = False

    def setup(self) -> None:
        """Join the process group, read the data, build the model and the stateful components."""
        config = self.config
        self.dist: DistInfo = init_distributed(config.dist_timeout_s)
        self.device = torch.device(f"cuda:{self.dist.local_rank}" if torch.cuda.is_available() else "cpu")
        torch.set_num_threads(config.num_threads)
        seed_everything(self.seed)
        paths = self.paths
        self.data = TrainData.build(
            config, self.features, seed=self.seed, fbank_dir=paths.fbank_dir, lang_dir=paths.lang_dir, dist=self.dist
        )
        self.model_config = config.model(self.features.num_mel_bins, self.data.tokenizer.vocab_size)
        self.model = build_model(self.model_config).to(self.device)
        self.precision = resolve_precision(
            config.precision,
            self.device.type,
            device_capability(self.device),
            native_bf16_cpu_flags() if self.device.type == "cpu" else (),
        )
        self.optimizer = build_optimizer(self.model, lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, config.warmup_steps)
        self.scaler = self.precision.grad_scaler()
        self.guard = NonFiniteGuard.for_run(config, self.paths.bad_batches, writes_records=self.dist.is_main)
        self.counters, self.history = RunCounters(), LossHistory()
        self.position = PlanPosition(self.data.batches, self.dist.world_size)
        fingerprint = build_fingerprint(
            asdict(self.model_config),
            asdict(self.features),
            data_digest=self.data.digest,
            seed=self.seed,
            config=config,
        )
        self.train_params = training_params(config, source_digest(__name__))
        check_same_everywhere(self.dist, content_digest([fingerprint, self.train_params]), "params, code or data")
        facts = {"fingerprint": fingerprint, "train_params": self.train_params, "precision": self.precision.name}
        self.checkpoints = CheckpointManager.for_run(config, paths.checkpoint_dir, dist=self.dist, facts=facts)
        self.checkpoints.register(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            scaler=self.scaler,
            rng=RandomState(),
            counters=self.counters,
            position=self.position,
            history=self.history,
            guard=self.guard,
        )
        data, precision = self.data, self.precision
        logger.info(
            f"model: {count_parameters(self.model)} parameters; {data.num_train} train / {data.num_dev} dev "
            f"utterances ({data.removed_for_ctc} removed as too short for CTC); precision {precision.name} "
            f"({precision.reason}); device {self.device}; world size {self.dist.world_size}"
        )

    def request_stop(self) -> None:
        """Make the step in flight the last: it finishes, a checkpoint is saved, :meth:`run` exits 75."""
        self.stop_requested = True

    def run(self) -> dict:
        """Train to the end (resuming if checkpoints allow), write the model bundle, return a summary."""
        self.setup()
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        status = "FAILED"
        try:
            loader = self._start_or_resume()
            devices = [self.dist.local_rank] if self.device.type == "cuda" else None
            self.ddp_model = self.model
            if self.dist.enabled:
                self.ddp_model = DistributedDataParallel(self.model, device_ids=devices)
            self.ddp_model.train()
            label = f"rank {self.dist.rank}: " if self.dist.enabled else ""  # labels its stack dumps
            with StallWatchdog(self.config.stall_timeout_s, label) as watchdog:
                finished = self._train_with_rollbacks(loader, watchdog)
            if not finished:
                status = "KILLED"
                step = self.counters.global_step
                logger.warning(f"stopped at step {step} with a checkpoint saved; run the same command again to resume")
                raise SystemExit(EXIT_INTERRUPTED)
            summary = self._finish()
            status = "FINISHED"
            return summary
        except Exception as error:
            failure = describe_failure(error, distributed=self.dist.enabled)
            if failure is None:
                raise
            logger.error("stopping: %s; run the same command again to resume from the last checkpoint", failure[1])
            raise SystemExit(failure[0]) from error
        finally:
            self.data.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.tracker.end(status)  # also flushes points past the last checkpoint: a resume skips them
            shutdown_distributed()

    # ---------------------------------------------------------------- the loop
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
        accum_grad = self.config.accum_grad
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
                step_tokens=micro_batches[0]["step_tokens"],
                optimizer=self.optimizer,
                scaler=self.scaler,
                precision=self.precision,
                max_grad_norm=self.config.max_grad_norm,
                dist=self.dist,
                device=self.device,
                inject_nonfinite=self.config.injects_nonfinite(step, self.dist.rank),
                stop_requested=functools.partial(self._stop_flag, step),
                seed=self.seed,
            )
            self.scheduler.step()
            watchdog.beat()
            item = micro_batches[0]["item"]
            result = replace(
                result, elapsed_s=time.perf_counter() - began, data_wait_s=waited, cut_ids=item.step_cut_ids
            )
            self.counters.global_step = step
            self.position.advance(item)
            self.guard.observe(
                step, finite=result.finite, loss=result.loss, grad_norm=result.grad_norm, cut_ids=list(result.cut_ids)
            )
            self._report(result)
            for observer in self.observers:
                observer.after_step(self, result)
            improved_loss = self._validate(watchdog) if self.config.validation_due(step) else None
            in_streak = self.guard.consecutive > 0
            if self.checkpoints.due(step, improved=improved_loss is not None, stop=result.stop, in_streak=in_streak):
                self._save(dev_loss=improved_loss)
            if result.stop:
                return False

    def _stop_flag(self, step: int) -> bool:
        """Read by :func:`train_step` right before its all-reduce: True makes the step in flight the last."""
        for observer in self.observers:
            observer.in_step(self, step)
        return self.stop_requested

    def _report(self, result: StepResult) -> None:
        """The step's metrics to MLflow (rank 0), the loss history, and a log line now and then."""
        lr, epoch, step = self.optimizer.param_groups[0]["lr"], self.position.epoch, self.counters.global_step
        skipped, world_size = self.guard.total_skipped, self.dist.world_size
        metrics = step_metrics(result, lr=lr, epoch=epoch, world_size=world_size, skipped_total=skipped)
        loss_scale = self.scaler.get_scale() if self.precision.uses_scaler else None
        report_step(self.tracker, self.history, step=step, metrics=metrics, loss_scale=loss_scale)
        if self.terminal_progress is not None:  # the terminal's progress line (rank 0)
            self.terminal_progress.update(step, epoch, result.loss, metrics["train/audio_s_per_s"])

    def _validate(self, watchdog: StallWatchdog) -> float | None:
        """Dev loss of the current weights, logged; returned when it beats the best checkpoint's (every rank
        gets rank 0's verdict), else None (also without dev data)."""
        if not self.data.dev_batches:
            return None
        loss = self.data.dev_loss(
            self.ddp_model, precision=self.precision, dist=self.dist, device=self.device, beat=watchdog.beat
        )
        watchdog.beat()
        step = self.counters.global_step
        self.counters.last_dev_loss, self.counters.last_dev_step = loss, step
        self.tracker.record(step, {"dev/loss": loss})
        logger.info("step %d: dev loss %.4f", step, loss)
        return loss if self.checkpoints.improved(loss) else None

    def _save(self, dev_loss: float | None = None, complete: bool = False) -> None:
        """Checkpoint (every rank takes part), then send MLflow the points it covers."""
        self.checkpoints.save(
            self.counters.global_step, dev_loss=dev_loss, in_streak=self.guard.consecutive > 0, complete=complete
        )
        self.tracker.flush()

    def _rollback(self) -> None:
        """Back to the newest good checkpoint with a lower learning rate; the run's guard totals are kept."""
        state, path = self.checkpoints.rollback_target()
        lr_scale = self.counters.lr_scale * self.config.rollback_lr_factor
        skipped, rollbacks = self.guard.total_skipped, self.guard.rollbacks
        self.tracker.discard_after(int(state["step"]))  # the abandoned steps are trained again
        self.checkpoints.restore(state)
        self.guard.rolled_back(skipped_before=skipped, rollbacks_before=rollbacks)
        self.counters.lr_scale = lr_scale
        apply_lr_scale(self.scheduler, self.config.lr * lr_scale)
        logger.warning(
            f"rollback {self.guard.rollbacks} of at most {self.config.max_rollbacks}: back to {path} (step "
            f"{self.counters.global_step}), learning rate scaled to {lr_scale:.3g} x train.lr"
        )

    # ---------------------------------------------------------------- start and end
    def _start_or_resume(self) -> Iterator[dict]:
        """Rank 0 decides (fresh or resume) and the components are restored; the data loader opens at the
        position and is returned. MLflow (rank 0) opens in the background after the first step."""
        decision, state, path = self.checkpoints.resume(self.checkpoints.facts["fingerprint"], self.train_params)
        if state is not None:
            self.checkpoints.restore(state)  # the tracker is not registered yet: it starts below
            position = self.position
            logger.info(
                f"resuming from {path}: step {self.counters.global_step}, epoch {position.epoch}, batch "
                f"{position.step_in_epoch} of the epoch"
            )
        for observer in self.observers:
            observer.on_start(self)
        loader = self.data.open(self.position.epoch, self.position.step_in_epoch)
        if self.dist.is_main:  # names and tags the run, logs the datasets, starts MLflow's system metrics
            self.tracker = BackgroundTracker.start_training(
                self.all_params,
                self.data.manifests,
                experiment=self.config.experiment,
                run_id=state["tracker"].get("run_id") if state else None,
                tracking_uri=self.tracking_uri,
            )
            self.terminal_progress = TerminalProgress(
                total_steps=self.data.steps_per_epoch(0) * self.config.epochs, start_step=self.counters.global_step
            )
        self.checkpoints.register(tracker=self.tracker)
        if state is None:
            logger.info("starting a fresh run")
            self.tracker.log_params(flatten(self.all_params))
            self.tracker.set_tags({"precision": self.precision.name, "precision_reason": self.precision.reason})
            self._save()  # step 0: a rollback target, and the MLflow run id on disk
        else:
            self.tracker.load_state_dict(state["tracker"])
            self.tracker.set_tags(precision_change_tags(state["precision"], self.precision, self.counters.global_step))
        return loader

    def _finish(self) -> dict:
        """The final checkpoint on every rank; rank 0 then writes the bundle, the loss plot and the artifacts."""
        self._save(complete=True)
        summary = {
            "steps": self.counters.global_step,
            "epochs": self.config.epochs,
            "best_dev_loss": self.checkpoints.best_dev_loss,
            "nonfinite_skipped": self.guard.total_skipped,
            "rollbacks": self.guard.rollbacks,
            "removed_for_ctc": self.data.removed_for_ctc,
            "precision": self.precision.name,
        }
        if self.dist.is_main:
            write_final_model(self, summary)
        return summary

    def _on_signal(self, signum, _frame) -> None:
        """SIGTERM/SIGINT: finish the step in flight, save, exit 75."""
        logger.warning("received %s: finishing the current step, then saving a checkpoint", signal.Signals(signum).name)
        self.request_stop()
