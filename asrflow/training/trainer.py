"""Training orchestration: data, model, resume, the step loop, checkpoints, tracking, the final model.

The pieces live in their own modules (``step``, ``checkpoint``, ``resume``, ``precision``,
``guards``, ``distributed``, ``watchdog``, ``validation``); this one wires them together.
"""

from __future__ import annotations

import csv
import logging
import math
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from asrflow.bundle import save_bundle
from asrflow.data.batches import AsrBatchDataset, TrainingBatches, plan_digest
from asrflow.data.features import CMVN_FILE, FeatureConfig, cmvn_stats, load_cmvn
from asrflow.data.filters import filter_ctc_feasible
from asrflow.data.manifests import cuts_path, load_cuts
from asrflow.data.workers import init_worker, pass_through
from asrflow.errors import AsrflowError
from asrflow.io import atomic_path
from asrflow.model.conformer_ctc import build_model, count_parameters
from asrflow.params import flatten
from asrflow.source import source_digest
from asrflow.tokenizer import MODEL_FILE, Tokenizer
from asrflow.tracking import RunTracker
from asrflow.training import checkpoint as ckpt
from asrflow.training.config import TrainConfig
from asrflow.training.distributed import DistInfo, barrier, init_distributed, shutdown_distributed
from asrflow.training.guards import NonFiniteGuard, RollbackNeeded
from asrflow.training.precision import device_capability, resolve_precision
from asrflow.training.resume import FRESH, build_fingerprint, decide, file_digest, training_params
from asrflow.training.rng import capture_rng_state, restore_rng_state, seed_everything
from asrflow.training.schedule import build_scheduler
from asrflow.training.step import StepResult, train_step
from asrflow.training.validation import dev_batches, dev_loss
from asrflow.training.watchdog import StallWatchdog

logger = logging.getLogger("asrflow.train")

#: Exit code after SIGTERM/SIGINT: the step finished, a checkpoint was saved; run again to resume.
EXIT_INTERRUPTED = 75
#: With fp16, a warning is logged when the gradient scaler's scale falls below this.
LOSS_SCALE_FLOOR = 1.0


@dataclass(frozen=True)
class TrainPaths:
    """Inputs and outputs of the train stage."""

    fbank_dir: Path = Path("data/fbank")
    lang_dir: Path = Path("data/lang")
    model_path: Path = Path("exp/model.pt")
    checkpoint_dir: Path = Path("exp/checkpoints")
    loss_csv: Path = Path("exp/plots/train_loss.csv")
    bad_batches: Path = Path("exp/bad_batches.jsonl")


@dataclass
class Progress:
    """Where training stands; all of it goes into every checkpoint."""

    global_step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    lr_scale: float = 1.0
    best_dev_loss: float = math.inf
    last_dev_loss: float = math.nan
    last_dev_step: int = -1
    history: dict[str, list[float]] = field(default_factory=lambda: {"step": [], "loss": [], "grad_norm": []})


class Trainer:
    """Runs (or resumes) one training run described by ``config`` and writes the model bundle."""

    def __init__(
        self,
        config: TrainConfig,
        features: FeatureConfig,
        seed: int,
        all_params: dict,
        paths: TrainPaths = TrainPaths(),
        tracking_uri: str | None = None,
    ):
        self.config = config
        self.features = features
        self.seed = seed
        self.all_params = all_params
        self.paths = paths
        self.tracking_uri = tracking_uri
        self._stop_requested = False

    # ---------------------------------------------------------------- set-up
    def _setup(self) -> None:
        config = self.config
        self.dist: DistInfo = init_distributed(config.dist_timeout_s)
        self.device = torch.device(f"cuda:{self.dist.local_rank}" if torch.cuda.is_available() else "cpu")
        torch.set_num_threads(config.num_threads)
        seed_everything(self.seed)
        tokenizer_path = self.paths.lang_dir / MODEL_FILE
        if not tokenizer_path.is_file():
            raise AsrflowError(f"{tokenizer_path} not found: run the tokenizer stage first")
        self.tokenizer = Tokenizer(tokenizer_path)
        self.cmvn_path = self.paths.fbank_dir / CMVN_FILE
        mvn = load_cmvn(self.cmvn_path)
        train_cuts, removed = filter_ctc_feasible(
            load_cuts(self.paths.fbank_dir, "train").to_eager(), self.tokenizer, self.features.frame_shift_s
        )
        self.removed_for_ctc = len(removed)
        if len(train_cuts) == 0:
            raise AsrflowError("no train utterance is long enough for its transcript; check the data")
        dev_cuts, _ = filter_ctc_feasible(
            load_cuts(self.paths.fbank_dir, "dev").to_eager(), self.tokenizer, self.features.frame_shift_s
        )
        self.train_cuts = train_cuts
        extractor = self.features.extractor() if self.features.on_the_fly else None
        noise = self._noise_cuts()
        self.dataset = AsrBatchDataset(
            train_cuts, self.tokenizer, mvn, self.seed, config.augment(), extractor, noise
        )
        self.dev_dataset = AsrBatchDataset(dev_cuts, self.tokenizer, mvn, self.seed, None, extractor)
        self.dev_batches = dev_batches(dev_cuts, config.max_duration_s)

        self.model_config = config.model(self.features.num_mel_bins, self.tokenizer.vocab_size)
        self.model = build_model(self.model_config).to(self.device)
        self.precision = resolve_precision(config.precision, self.device.type, device_capability(self.device))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, config.warmup_steps)
        self.scaler = self.precision.grad_scaler()
        self.guard = NonFiniteGuard(config.max_consecutive_nonfinite, config.max_rollbacks, self.paths.bad_batches)
        self.progress = Progress()
        self.fingerprint = build_fingerprint(
            asdict(self.model_config),
            asdict(self.features),
            file_digest(tokenizer_path, cuts_path(self.paths.fbank_dir, "train"), self.cmvn_path),
            self.seed,
            config,
        )
        self.train_params = training_params(config, source_digest(__name__))
        logger.info(
            "model: %d parameters; %d train / %d dev utterances (%d removed as too short for CTC); "
            "precision %s (%s); device %s; world size %d",
            count_parameters(self.model), len(train_cuts), len(dev_cuts), self.removed_for_ctc,
            self.precision.name, self.precision.reason, self.device, self.dist.world_size,
        )

    def _noise_cuts(self):
        if not self.config.noise_dir:
            return None
        if not self.features.on_the_fly:
            raise AsrflowError("train.noise_dir needs features.on_the_fly: true (noise is mixed into audio)")
        from lhotse import CutSet, RecordingSet

        noise_dir = Path(self.config.noise_dir)
        recordings = RecordingSet.from_dir(noise_dir, pattern="*.wav")
        if len(recordings) == 0:
            raise AsrflowError(f"train.noise_dir {noise_dir} holds no .wav files")
        return CutSet.from_manifests(recordings=recordings).resample(self.features.sampling_rate)

    # ---------------------------------------------------------------- checkpoints
    def _state(self, complete: bool) -> dict:
        progress = self.progress
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": capture_rng_state(),
            "progress": {
                "global_step": progress.global_step,
                "epoch": progress.epoch,
                "step_in_epoch": progress.step_in_epoch,
                "lr_scale": progress.lr_scale,
                "best_dev_loss": progress.best_dev_loss,
                "last_dev_loss": progress.last_dev_loss,
                "last_dev_step": progress.last_dev_step,
                "history": progress.history,
            },
            "guard": self.guard.state_dict(),
            "world_size": self.dist.world_size,
            "plan_digest": plan_digest(self.batches.plan(progress.epoch)) if hasattr(self, "batches") else "",
            "fingerprint": self.fingerprint,
            "train_params": self.train_params,
            "tracker": self.tracker.state_dict() if self.tracker else {},
            "complete": complete,
        }

    def _save(self, complete: bool = False) -> None:
        """Rank 0 writes (then flushes MLflow); the other ranks wait at a barrier."""
        progress = self.progress
        if self.dist.is_main:
            is_best = progress.last_dev_step == progress.global_step and progress.last_dev_loss < progress.best_dev_loss
            if is_best:
                progress.best_dev_loss = progress.last_dev_loss
            path = ckpt.save_checkpoint(
                self._state(complete), self.paths.checkpoint_dir, progress.global_step, self.config.keep_last, is_best
            )
            if self.tracker:
                self.tracker.flush()
            logger.info("saved checkpoint %s", path)
        barrier(self.dist)

    def _restore(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        restore_rng_state(state["rng"])
        saved = state["progress"]
        self.progress = Progress(
            global_step=int(saved["global_step"]),
            epoch=int(saved["epoch"]),
            step_in_epoch=int(saved["step_in_epoch"]),
            lr_scale=float(saved["lr_scale"]),
            best_dev_loss=float(saved["best_dev_loss"]),
            last_dev_loss=float(saved["last_dev_loss"]),
            last_dev_step=int(saved["last_dev_step"]),
            history={key: list(values) for key, values in saved["history"].items()},
        )
        self.guard.load_state_dict(state["guard"])
        self._apply_lr_scale()
        if int(state["world_size"]) != self.dist.world_size:
            logger.warning(
                "the checkpoint was written with %d processes, this run has %d: the batch plan differs, "
                "so epoch %d restarts from its first batch (optimizer, schedule and step count are kept)",
                state["world_size"], self.dist.world_size, self.progress.epoch,
            )
            self.progress.step_in_epoch = 0

    def _apply_lr_scale(self) -> None:
        self.scheduler.base_lrs = [self.config.lr * self.progress.lr_scale for _ in self.scheduler.base_lrs]
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = base * self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)

    def _start_or_resume(self) -> None:
        latest = ckpt.load_latest(self.paths.checkpoint_dir)
        state, path = latest if latest else (None, None)
        decision = decide(state, self.fingerprint, self.train_params, self.paths.checkpoint_dir)
        run_id = None
        if decision == FRESH:
            if state is not None and self.dist.is_main:
                ckpt.remove_checkpoints(self.paths.checkpoint_dir)
            barrier(self.dist)
            logger.info("starting a fresh run")
        else:
            self._restore(state)
            run_id = state["tracker"].get("run_id") if state["tracker"] else None
            logger.info(
                "resuming from %s: step %d, epoch %d, batch %d of the epoch",
                path, self.progress.global_step, self.progress.epoch, self.progress.step_in_epoch,
            )
        self.tracker = None
        if self.dist.is_main:
            self.tracker = RunTracker.start(
                experiment=self.config.experiment, run_id=run_id, run_name="train", tracking_uri=self.tracking_uri
            )
            if decision == FRESH:
                self.tracker.log_params(flatten(self.all_params))
                self.tracker.set_tags({"precision": self.precision.name, "precision_reason": self.precision.reason})
            else:
                self.tracker.load_state_dict(state["tracker"])
        if decision == FRESH:
            self._save()  # step 0: a rollback target, and the MLflow run id on disk

    # ---------------------------------------------------------------- the loop
    def _loader(self) -> torch.utils.data.DataLoader:
        config = self.config
        self.batches = TrainingBatches(
            self.train_cuts, self.seed, config.max_duration_s, config.num_buckets, config.accum_grad,
            self.dist.world_size, self.dist.rank, self.progress.epoch, self.progress.step_in_epoch, config.epochs,
        )
        workers = config.num_workers
        return torch.utils.data.DataLoader(
            self.dataset,
            sampler=self.batches,
            batch_size=None,
            collate_fn=pass_through,
            num_workers=workers,
            multiprocessing_context=config.mp_start_method if workers else None,
            worker_init_fn=init_worker if workers else None,
            prefetch_factor=4 if workers else None,
            # Its own generator: iter() draws the workers' base seed from it, not from the global torch
            # RNG, which a resume restores from the checkpoint and a draw here would shift (exact resume).
            generator=torch.Generator().manual_seed(self.seed),
        )

    def _on_signal(self, signum, _frame) -> None:
        logger.warning("received %s: finishing the current step, then saving a checkpoint", signal.Signals(signum).name)
        self._stop_requested = True

    def _run_steps(self, watchdog: StallWatchdog) -> bool:
        """Train until the last epoch ends (True) or a stop was requested (False)."""
        config = self.config
        loader = iter(self._loader())
        while True:
            wait_start = time.perf_counter()
            micro_batches = []
            for _ in range(config.accum_grad):
                batch = next(loader, None)
                if batch is None:
                    return True
                micro_batches.append(batch)
            waited = time.perf_counter() - wait_start
            item = micro_batches[0]["item"]
            step_number = self.progress.global_step + 1
            result = train_step(
                self.ddp_model, micro_batches, micro_batches[0]["step_tokens"], self.optimizer, self.scaler,
                self.precision, config.max_grad_norm, self.dist, self.device,
                inject_nonfinite=step_number in config.inject_nonfinite_steps,
                stop_requested=self._stop_requested, seed=self.seed,
            )
            self.scheduler.step()
            elapsed = time.perf_counter() - wait_start
            watchdog.beat()
            self.progress.global_step = step_number
            self.progress.epoch = item.epoch
            self.progress.step_in_epoch = item.step_in_epoch + 1
            cut_ids = [cut_id for batch in micro_batches for cut_id in batch["cut_ids"]]
            self.guard.observe(step_number, result.finite, result.loss, result.grad_norm, cut_ids)
            self._record(result, waited, elapsed)
            if config.validate_every_steps and step_number % config.validate_every_steps == 0:
                self._validate(watchdog)
            if result.stop:
                self._save()
                return False
            if step_number % config.checkpoint_every_steps == 0:
                self._save()

    def _record(self, result: StepResult, waited: float, elapsed: float) -> None:
        progress = self.progress
        step = progress.global_step
        lr = self.optimizer.param_groups[0]["lr"]
        progress.history["step"].append(step)
        progress.history["loss"].append(result.loss)
        progress.history["grad_norm"].append(result.grad_norm)
        metrics = {
            "train/loss": result.loss,
            "train/lr": lr,
            "train/grad_norm": result.grad_norm,
            "train/audio_s_per_s": result.audio_seconds * self.dist.world_size / max(elapsed, 1e-9),
            "train/padding_ratio": result.padding_ratio,
            "train/data_wait_fraction": waited / max(elapsed, 1e-9),
            "train/nonfinite_skipped": self.guard.total_skipped,
            "train/epoch": progress.epoch,
        }
        if self.precision.uses_scaler:
            scale = self.scaler.get_scale()
            metrics["train/loss_scale"] = scale
            if scale < LOSS_SCALE_FLOOR:
                logger.warning("fp16 loss scale collapsed to %g (< %g): consider bf16 or fp32", scale, LOSS_SCALE_FLOOR)
        if self.tracker:
            self.tracker.record(step, {k: v for k, v in metrics.items() if math.isfinite(v)})
        if step % 10 == 0 or step == 1:
            logger.info(
                "step %d epoch %d: loss %.4f lr %.2e grad norm %.3f, %.1f audio s/s, padding %.1f%%, data wait %.1f%%",
                step, progress.epoch, result.loss, lr, result.grad_norm, metrics["train/audio_s_per_s"],
                100 * result.padding_ratio, 100 * metrics["train/data_wait_fraction"],
            )

    def _validate(self, watchdog: StallWatchdog) -> None:
        if not self.dev_batches:
            return
        loss = dev_loss(self.ddp_model, self.dev_dataset, self.dev_batches, self.precision, self.dist, self.device)
        watchdog.beat()
        self.progress.last_dev_loss = loss
        self.progress.last_dev_step = self.progress.global_step
        if self.tracker:
            self.tracker.record(self.progress.global_step, {"dev/loss": loss})
        logger.info("step %d: dev loss %.4f", self.progress.global_step, loss)

    def _rollback(self) -> None:
        rollbacks = self.guard.rollbacks + 1
        latest = ckpt.load_latest(self.paths.checkpoint_dir)
        if latest is None:
            raise AsrflowError("non-finite steps and no checkpoint to roll back to")
        state, path = latest
        lr_scale = self.progress.lr_scale * self.config.rollback_lr_factor
        skipped = self.guard.total_skipped
        self._restore(state)
        # The checkpoint's guard counts are older: keep the run's totals (bad_batches.jsonl lists
        # every skipped step), count this rollback and restart the count of skips in a row.
        self.guard.total_skipped = skipped
        self.guard.rollbacks = rollbacks - 1
        self.guard.rolled_back()
        self.progress.lr_scale = lr_scale
        self._apply_lr_scale()
        if self.tracker:
            self.tracker.load_state_dict(state["tracker"])
        logger.warning(
            "rollback %d of at most %d: back to %s (step %d), learning rate scaled to %.3g x train.lr",
            rollbacks, self.config.max_rollbacks, path, self.progress.global_step, lr_scale,
        )

    # ---------------------------------------------------------------- outputs
    def _finish(self) -> dict:
        self._save(complete=True)
        summary = {
            "steps": self.progress.global_step,
            "epochs": self.config.epochs,
            "best_dev_loss": self.progress.best_dev_loss,
            "nonfinite_skipped": self.guard.total_skipped,
            "rollbacks": self.guard.rollbacks,
            "removed_for_ctc": self.removed_for_ctc,
            "precision": self.precision.name,
        }
        if not self.dist.is_main:
            return summary
        # Average only checkpoints from the second half of training: early weights would hurt.
        late = [path for path in ckpt.list_checkpoints(self.paths.checkpoint_dir)
                if ckpt.step_of(path) * 2 >= self.progress.global_step]
        recent = late[: max(self.config.average_last, 1)]
        weights = ckpt.average_model_states(recent)
        logger.info("final model: average of %s", ", ".join(path.name for path in recent))
        cmvn = cmvn_stats(load_cmvn(self.cmvn_path))
        run_id = self.tracker.run_id if self.tracker else None
        save_bundle(
            self.paths.model_path, weights, self.model_config, self.tokenizer, self.features, cmvn, run_id,
            info={**summary, "averaged": [path.name for path in recent]},
        )
        with atomic_path(self.paths.loss_csv) as tmp, open(tmp, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["step", "loss"])
            for step, loss in zip(self.progress.history["step"], self.progress.history["loss"], strict=True):
                writer.writerow([step, f"{loss:.6f}"])
        if self.tracker:
            self.tracker.record(self.progress.global_step, {"train/final_best_dev_loss": self.progress.best_dev_loss})
            self.tracker.flush()
            self.tracker.log_artifact(self.paths.model_path, artifact_path="model")
            self.tracker.log_artifact(self.paths.lang_dir / MODEL_FILE, artifact_path="tokenizer")
            params_file = Path("params.yaml")
            if params_file.is_file():
                self.tracker.log_artifact(params_file, artifact_path="params")
            self.tracker.log_artifact(self.paths.loss_csv, artifact_path="plots")
        return summary

    def run(self) -> dict:
        """Train to the end (resuming if checkpoints allow) and write the model bundle."""
        self._setup()
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        status = "FAILED"
        try:
            self._start_or_resume()
            device_ids = [self.dist.local_rank] if self.device.type == "cuda" else None
            self.ddp_model = (
                DistributedDataParallel(self.model, device_ids=device_ids) if self.dist.enabled else self.model
            )
            self.ddp_model.train()
            label = f"rank {self.dist.rank}: " if self.dist.enabled else ""
            with StallWatchdog(self.config.stall_timeout_s, label) as watchdog:
                while True:
                    try:
                        finished = self._run_steps(watchdog)
                        break
                    except RollbackNeeded:
                        self._rollback()
            if not finished:
                status = "KILLED"
                logger.warning(
                    "stopped at step %d with a checkpoint saved; run the same command again to resume",
                    self.progress.global_step,
                )
                raise SystemExit(EXIT_INTERRUPTED)
            summary = self._finish()
            status = "FINISHED"
            return summary
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.dist.is_main and getattr(self, "tracker", None):
                # Points recorded after the last checkpoint stay unflushed: a resume re-runs those steps.
                self.tracker.end(status)
            shutdown_distributed()
