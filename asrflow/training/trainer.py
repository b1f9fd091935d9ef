"""Training: an explicit loop that calls components, each owning its policy and its state.

* :class:`~asrflow.training.train_data.TrainData`: tokenizer, CMVN, batch plan, datasets, loader;
* :class:`~asrflow.training.checkpoint_manager.CheckpointManager`: when to save, best, keep-last,
  rollback target, resume decision; a checkpoint is the dict of the registered components' states;
* :class:`~asrflow.training.guards.NonFiniteGuard`: skipped steps, rollbacks;
* :mod:`~asrflow.training.progress`: step count, plan position, loss history, random state;
* the tracker (MLflow on rank 0, :class:`~asrflow.tracking.NullTracker` elsewhere);
* observers (:mod:`asrflow.training.observers`): the one extension point.

The order inside a step is what makes resume exact: the stop flag is read right before the
step's all-reduce, no checkpoint is taken inside a non-finite streak, and MLflow is flushed
only after the checkpoint is on disk.
"""

from __future__ import annotations

import copy
import functools
import logging
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, replace

import torch
from torch.nn.parallel import DistributedDataParallel

from asrflow.bundle import save_bundle
from asrflow.data.features import FeatureConfig, cmvn_stats, load_cmvn
from asrflow.data.workers import unpack_batch
from asrflow.logs import StepProgress
from asrflow.model.conformer_ctc import build_model, count_parameters
from asrflow.params import flatten
from asrflow.source import source_digest
from asrflow.tracking import NullTracker, RunTracker
from asrflow.training.checkpoint import content_digest
from asrflow.training.checkpoint_manager import CheckpointManager
from asrflow.training.config import TrainConfig
from asrflow.training.dev_loss import dev_loss
from asrflow.training.distributed import DistInfo, check_same_everywhere, init_distributed, shutdown_distributed
from asrflow.training.failures import describe_failure
from asrflow.training.final_model import final_weights, log_final_run, write_loss_csv
from asrflow.training.guards import NonFiniteGuard, RollbackNeeded
from asrflow.training.observers import TrainObserver
from asrflow.training.paths import TrainPaths
from asrflow.training.precision import device_capability, precision_change_tags, resolve_precision
from asrflow.training.progress import LossHistory, PlanPosition, Progress, RandomState
from asrflow.training.resume import build_fingerprint, training_params
from asrflow.training.rng import seed_everything
from asrflow.training.schedule import apply_lr_scale, build_scheduler
from asrflow.training.step import StepResult, train_step
from asrflow.training.step_log import report_step, step_metrics
from asrflow.training.train_data import TrainData
from asrflow.training.watchdog import StallWatchdog

logger = logging.getLogger(__name__)

#: Exit code after SIGTERM/SIGINT: the step finished, a checkpoint was saved; run again to resume.
EXIT_INTERRUPTED = 75


class Trainer:
    """Runs (or resumes) one training run described by ``config`` and writes the model bundle.

    Args:
        config, features: the ``train:`` and ``features:`` params.
        seed: the run's seed (params ``seed``).
        all_params: every param, logged to MLflow as the run's params.
        paths: inputs and outputs (see :class:`~asrflow.training.paths.TrainPaths`).
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
        self.tracker: RunTracker | NullTracker = NullTracker()
        self.step_progress: StepProgress | None = None
        self.stop_requested = False

    def setup(self) -> None:
        """Join the process group, read the data, build the model and the stateful components."""
        config = self.config
        self.dist: DistInfo = init_distributed(config.dist_timeout_s)
        self.device = torch.device(f"cuda:{self.dist.local_rank}" if torch.cuda.is_available() else "cpu")
        torch.set_num_threads(config.num_threads)
        seed_everything(self.seed)
        self.data = TrainData.build(
            config, self.features, seed=self.seed, fbank_dir=self.paths.fbank_dir, lang_dir=self.paths.lang_dir,
            world_size=self.dist.world_size, rank=self.dist.rank,
        )
        self.model_config = config.model(self.features.num_mel_bins, self.data.tokenizer.vocab_size)
        self.model = build_model(self.model_config).to(self.device)
        self.precision = resolve_precision(config.precision, self.device.type, device_capability(self.device))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, config.warmup_steps)
        self.scaler = self.precision.grad_scaler()
        self.guard = NonFiniteGuard(
            max_consecutive=config.max_consecutive_nonfinite, max_rollbacks=config.max_rollbacks,
            bad_batches_path=self.paths.bad_batches, writes_records=self.dist.is_main,
        )
        self.progress, self.history = Progress(), LossHistory()
        self.position = PlanPosition(self.data.batches, self.dist.world_size)
        fingerprint = build_fingerprint(
            asdict(self.model_config), asdict(self.features), data_digest=self.data.digest, seed=self.seed,
            config=config,
        )
        self.train_params = training_params(config, source_digest(__name__))
        check_same_everywhere(self.dist, content_digest([fingerprint, self.train_params]), "params, code or data")
        self.checkpoints = CheckpointManager(
            self.paths.checkpoint_dir, every_steps=config.checkpoint_every_steps, keep_last=config.keep_last,
            dist=self.dist,
            facts={"fingerprint": fingerprint, "train_params": self.train_params, "precision": self.precision.name},
        )
        self.checkpoints.register(
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, scaler=self.scaler,
            rng=RandomState(), progress=self.progress, position=self.position, history=self.history,
            guard=self.guard,
        )
        logger.info(
            "model: %d parameters; %d train / %d dev utterances (%d removed as too short for CTC); "
            "precision %s (%s); device %s; world size %d",
            count_parameters(self.model), self.data.num_train, self.data.num_dev, self.data.removed_for_ctc,
            self.precision.name, self.precision.reason, self.device, self.dist.world_size,
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
            for observer in self.observers:
                observer.on_start(self)
            label = f"rank {self.dist.rank}: " if self.dist.enabled else ""  # labels its stack dumps
            with StallWatchdog(self.config.stall_timeout_s, label) as watchdog:
                finished = self._train_with_rollbacks(loader, watchdog)
            if not finished:
                status = "KILLED"
                logger.warning("stopped at step %d with a checkpoint saved; run the same command again to resume",
                               self.progress.global_step)
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
            step = self.progress.global_step + 1
            result = train_step(
                self.ddp_model, micro_batches, step_tokens=micro_batches[0]["step_tokens"], optimizer=self.optimizer,
                scaler=self.scaler, precision=self.precision, max_grad_norm=self.config.max_grad_norm, dist=self.dist,
                device=self.device, inject_nonfinite=self.config.injects_nonfinite(step, self.dist.rank),
                stop_requested=functools.partial(self._stop_flag, step), seed=self.seed,
            )
            self.scheduler.step()
            watchdog.beat()
            item = micro_batches[0]["item"]
            result = replace(result, elapsed_s=time.perf_counter() - began, data_wait_s=waited,
                             cut_ids=item.step_cut_ids)
            self.progress.global_step = step
            self.position.advance(item)
            self.guard.observe(step, finite=result.finite, loss=result.loss, grad_norm=result.grad_norm,
                               cut_ids=list(result.cut_ids))
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
        metrics = step_metrics(result, lr=self.optimizer.param_groups[0]["lr"], epoch=self.position.epoch,
                               world_size=self.dist.world_size, skipped_total=self.guard.total_skipped)
        loss_scale = self.scaler.get_scale() if self.precision.uses_scaler else None
        report_step(self.tracker, self.history, step=self.progress.global_step, metrics=metrics, loss_scale=loss_scale)
        if self.step_progress is not None:  # the terminal's progress line (rank 0)
            self.step_progress.update(self.progress.global_step, self.position.epoch, result.loss,
                                      metrics["train/audio_s_per_s"])

    def _validate(self, watchdog: StallWatchdog) -> float | None:
        """Dev loss of the current weights, logged; returned when it beats the best checkpoint's (every rank
        gets rank 0's verdict), else None (also without dev data)."""
        if not self.data.dev_batches:
            return None
        loss = dev_loss(self.ddp_model, self.data.dev_dataset, self.data.dev_batches, precision=self.precision,
                        dist=self.dist, device=self.device, beat=watchdog.beat)
        watchdog.beat()
        step = self.progress.global_step
        self.progress.last_dev_loss, self.progress.last_dev_step = loss, step
        self.tracker.record(step, {"dev/loss": loss})
        logger.info("step %d: dev loss %.4f", step, loss)
        return loss if self.checkpoints.improved(loss) else None

    def _save(self, dev_loss: float | None = None, complete: bool = False) -> None:
        """Checkpoint (every rank takes part), then send MLflow the points it covers."""
        self.checkpoints.save(self.progress.global_step, dev_loss=dev_loss, in_streak=self.guard.consecutive > 0,
                              complete=complete)
        self.tracker.flush()

    def _rollback(self) -> None:
        """Back to the newest good checkpoint with a lower learning rate; the run's guard totals are kept."""
        state, path = self.checkpoints.rollback_target()
        lr_scale = self.progress.lr_scale * self.config.rollback_lr_factor
        skipped, rollbacks = self.guard.total_skipped, self.guard.rollbacks
        self.tracker.discard_after(int(state["step"]))  # the abandoned steps are trained again
        self.checkpoints.restore(state)
        self.guard.rolled_back(skipped_before=skipped, rollbacks_before=rollbacks)
        self.progress.lr_scale = lr_scale
        apply_lr_scale(self.scheduler, self.config.lr * lr_scale)
        logger.warning(
            "rollback %d of at most %d: back to %s (step %d), learning rate scaled to %.3g x train.lr",
            self.guard.rollbacks, self.config.max_rollbacks, path, self.progress.global_step, lr_scale,
        )

    # ---------------------------------------------------------------- start and end
    def _start_or_resume(self) -> Iterator[dict]:
        """Rank 0 decides (fresh or resume) and the components are restored; the data loader opens at the
        position (its workers start while MLflow does, on rank 0) and is returned."""
        decision, state, path = self.checkpoints.resume(self.checkpoints.facts["fingerprint"], self.train_params)
        if state is not None:
            self.checkpoints.restore(state)  # the tracker is not registered yet: it starts below
            logger.info("resuming from %s: step %d, epoch %d, batch %d of the epoch", path,
                        self.progress.global_step, self.position.epoch, self.position.step_in_epoch)
        loader = self.data.open(self.position.epoch, self.position.step_in_epoch)
        if self.dist.is_main:  # names and tags the run, logs the datasets, starts MLflow's system metrics
            self.tracker = RunTracker.start_training(
                self.all_params, self.data.manifests, experiment=self.config.experiment,
                run_id=state["tracker"].get("run_id") if state else None, tracking_uri=self.tracking_uri,
            )
            self.step_progress = StepProgress(total_steps=self.data.steps_per_epoch(0) * self.config.epochs,
                                              start_step=self.progress.global_step)
        self.checkpoints.register(tracker=self.tracker)
        if state is None:
            logger.info("starting a fresh run")
            self.tracker.log_params(flatten(self.all_params))
            self.tracker.set_tags({"precision": self.precision.name, "precision_reason": self.precision.reason})
            self._save()  # step 0: a rollback target, and the MLflow run id on disk
        else:
            self.tracker.load_state_dict(state["tracker"])
            self.tracker.set_tags(precision_change_tags(state["precision"], self.precision, self.progress.global_step))
        return loader

    def _finish(self) -> dict:
        """The final checkpoint on every rank; rank 0 then writes the bundle, the loss plot and the artifacts."""
        self._save(complete=True)
        summary = {
            "steps": self.progress.global_step,
            "epochs": self.config.epochs,
            "best_dev_loss": self.checkpoints.best_dev_loss,
            "nonfinite_skipped": self.guard.total_skipped,
            "rollbacks": self.guard.rollbacks,
            "removed_for_ctc": self.data.removed_for_ctc,
            "precision": self.precision.name,
        }
        if not self.dist.is_main:
            return summary
        recent = self.checkpoints.late_checkpoints(self.progress.global_step, self.config.average_last)
        last = {name: tensor.detach().cpu().clone() for name, tensor in self.model.state_dict().items()}
        weights, choice = final_weights(last, recent, self._dev_loss_of if self.data.dev_batches else None)
        save_bundle(
            self.paths.model_path, model_state=weights, model_config=self.model_config, tokenizer=self.data.tokenizer,
            features=self.features, cmvn=cmvn_stats(load_cmvn(self.data.cmvn_path)), run_id=self.tracker.run_id,
            info={**summary, "averaged": [path.name for path in recent], **choice},
        )
        write_loss_csv(self.paths.loss_csv, self.history)
        log_final_run(self.tracker, paths=self.paths, all_params=self.all_params, step=self.progress.global_step,
                      metrics={"train/final_best_dev_loss": self.checkpoints.best_dev_loss,
                               **{f"final/{key}": value for key, value in choice.items() if key.startswith("dev_")}},
                      register_model_name=self.config.register_model_name)
        return summary

    def _dev_loss_of(self, weights: dict[str, torch.Tensor]) -> float:
        """Dev loss (nats per token) of ``weights`` in this process alone (rank 0, no collectives)."""
        model = copy.deepcopy(self.model)  # a copy, not build_model: no draw from the torch RNG
        model.load_state_dict(weights)
        return dev_loss(model, self.data.dev_dataset, self.data.dev_batches, precision=self.precision, dist=DistInfo(),
                        device=self.device)

    def _on_signal(self, signum, _frame) -> None:
        """SIGTERM/SIGINT: finish the step in flight, save, exit 75."""
        logger.warning("received %s: finishing the current step, then saving a checkpoint", signal.Signals(signum).name)
        self.request_stop()
