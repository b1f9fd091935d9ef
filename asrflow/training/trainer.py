"""Training orchestration: data, model, resume, the step loop, checkpoints, tracking, the final model.

The pieces live in their own modules (``step``, ``checkpoint``, ``resume``, ``precision``,
``guards``, ``distributed``, ``watchdog``, ``validation``); this one wires them together.
"""

from __future__ import annotations

import copy
import csv
import logging
import math
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml
from torch.nn.parallel import DistributedDataParallel

from asrflow.bundle import save_bundle
from asrflow.data.batches import SPEED_FACTORS, AsrBatchDataset, TrainingBatches, plan_digest
from asrflow.data.features import CMVN_FILE, FeatureConfig, cmvn_stats, load_cmvn
from asrflow.data.filters import filter_ctc_feasible
from asrflow.data.manifests import cuts_path, load_cuts
from asrflow.data.workers import init_worker, pack_batch, unpack_batch
from asrflow.errors import AsrflowError
from asrflow.io import atomic_path
from asrflow.model.conformer_ctc import build_model, count_parameters
from asrflow.params import flatten
from asrflow.source import source_digest
from asrflow.tokenizer import MODEL_FILE, Tokenizer
from asrflow.tracking import RunTracker
from asrflow.training import checkpoint as ckpt
from asrflow.training.config import TrainConfig
from asrflow.training.distributed import (
    DistInfo,
    barrier,
    broadcast_from_main,
    init_distributed,
    shutdown_distributed,
)
from asrflow.training.guards import NonFiniteGuard, RollbackNeeded
from asrflow.training.precision import device_capability, resolve_precision
from asrflow.training.resume import FRESH, RESUME, build_fingerprint, decide, file_digest, training_params
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
    #: Step of the newest checkpoint taken outside a streak of non-finite steps: the rollback target.
    good_step: int = 0
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
        self._check_options()
        tokenizer_path = self.paths.lang_dir / MODEL_FILE
        if not tokenizer_path.is_file():
            raise AsrflowError(f"{tokenizer_path} not found: run the tokenizer stage first")
        self.tokenizer = Tokenizer(tokenizer_path)
        self.cmvn_path = self.paths.fbank_dir / CMVN_FILE
        mvn = load_cmvn(self.cmvn_path)
        max_speed = max(SPEED_FACTORS) if config.speed_perturb else 1.0
        train_cuts, removed = filter_ctc_feasible(
            load_cuts(self.paths.fbank_dir, "train").to_eager(), self.tokenizer, self.features.frame_shift_s,
            max_speed,
        )
        self.removed_for_ctc = len(removed)
        if len(train_cuts) == 0:
            raise AsrflowError("no train utterance is long enough for its transcript; check the data")
        dev_cuts, _ = filter_ctc_feasible(
            load_cuts(self.paths.fbank_dir, "dev").to_eager(), self.tokenizer, self.features.frame_shift_s
        )
        # One plan cache for the whole run: the resume check, checkpoints and the loader share it.
        self.batches = TrainingBatches(
            train_cuts, self.seed, config.max_duration_s, config.num_buckets, config.accum_grad,
            self.dist.world_size, self.dist.rank, 0, 0, config.epochs,
        )
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
        self.guard = NonFiniteGuard(
            config.max_consecutive_nonfinite, config.max_rollbacks, self.paths.bad_batches,
            writes_records=self.dist.is_main,
        )
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

    def _check_options(self) -> None:
        """Refuse option combinations that would be silently ignored; warn about weak ones."""
        config = self.config
        if config.speed_perturb and not self.features.on_the_fly:
            raise AsrflowError(
                "train.speed_perturb needs features.on_the_fly: true (speed perturbation changes the audio, "
                "and precomputed features have none): set features.on_the_fly: true or train.speed_perturb: false"
            )
        if config.keep_last < config.average_last:
            logger.warning(
                "train.keep_last (%d) < train.average_last (%d): at most %d checkpoints can be averaged",
                config.keep_last, config.average_last, config.keep_last,
            )

    def _noise_cuts(self):
        """Noise cuts for augmentation from ``train.noise_dir`` (see :mod:`asrflow.data.noise`), or None."""
        if not self.config.noise_dir:
            return None
        if not self.features.on_the_fly:
            raise AsrflowError("train.noise_dir needs features.on_the_fly: true (noise is mixed into audio)")
        from asrflow.data.noise import load_noise_cuts

        return load_noise_cuts(self.config.noise_dir, self.features.sampling_rate)

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
                "good_step": progress.good_step,
                "history": progress.history,
            },
            "guard": self.guard.state_dict(),
            "world_size": self.dist.world_size,
            "precision": self.precision.name,
            "plan_digest": plan_digest(self.batches.plan(progress.epoch)),
            "fingerprint": self.fingerprint,
            "train_params": self.train_params,
            "tracker": self.tracker.state_dict() if self.tracker else {},
            "complete": complete,
        }

    def _save(self, complete: bool = False) -> None:
        """Rank 0 writes (then flushes MLflow); the other ranks wait at a barrier.

        A checkpoint taken outside a streak of non-finite steps becomes the rollback target
        (``good_step``); pruning by ``keep_last`` never deletes the current one.
        """
        progress = self.progress
        if self.guard.consecutive == 0:
            progress.good_step = progress.global_step
        if self.dist.is_main:
            is_best = progress.last_dev_step == progress.global_step and progress.last_dev_loss < progress.best_dev_loss
            if is_best:
                progress.best_dev_loss = progress.last_dev_loss
            path = ckpt.save_checkpoint(
                self._state(complete), self.paths.checkpoint_dir, progress.global_step, self.config.keep_last, is_best,
                protect=progress.good_step,
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
            good_step=int(saved.get("good_step", state["step"])),
            history={key: list(values) for key, values in saved["history"].items()},
        )
        self.guard.load_state_dict(state["guard"])
        self._apply_lr_scale()
        self._check_position(state)

    def _check_position(self, state: dict) -> None:
        """Restart the epoch from its first batch when the checkpoint's position means other batches now."""
        epoch = self.progress.epoch
        if int(state["world_size"]) != self.dist.world_size:
            reason = (f"the checkpoint was written with {state['world_size']} processes, this run has "
                      f"{self.dist.world_size}: the batch plan differs")
        elif state.get("plan_digest") and plan_digest(self.batches.plan(epoch)) != state["plan_digest"]:
            reason = (f"the batch plan of epoch {epoch} differs from the checkpoint's (other train cuts or "
                      "another Lhotse sampler)")
        else:
            return
        logger.warning(
            "%s, so epoch %d restarts from its first batch (optimizer, schedule and step count are kept)",
            reason, epoch,
        )
        self.progress.step_in_epoch = 0

    def _apply_lr_scale(self) -> None:
        self.scheduler.base_lrs = [self.config.lr * self.progress.lr_scale for _ in self.scheduler.base_lrs]
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = base * self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)

    def _share_checkpoint(self, found: tuple[dict, Path] | None) -> tuple[dict, Path] | None:
        """Rank 0's choice of checkpoint on every rank: the others load the file rank 0 named.

        Every rank must call it (a broadcast); only rank 0's ``found`` counts.
        """
        path = broadcast_from_main(self.dist, str(found[1]) if found else None)
        if self.dist.is_main or path is None:
            return found
        return ckpt.load_checkpoint(path), Path(path)

    def _resume_decision(self) -> tuple[str, dict | None, Path | None]:
        """Rank 0 reads the newest checkpoint and decides; every rank gets (decision, state, path)."""
        found, verdict = None, None
        if self.dist.is_main:
            found = ckpt.load_latest(self.paths.checkpoint_dir)
            try:
                verdict = (decide(found[0] if found else None, self.fingerprint, self.train_params,
                                  self.paths.checkpoint_dir), None)
            except AsrflowError as error:
                verdict = (None, str(error))
        decision, error = broadcast_from_main(self.dist, verdict)
        if error:
            raise AsrflowError(error)
        shared = self._share_checkpoint(found if decision == RESUME else None)
        if decision == RESUME:
            return decision, *shared
        # A fresh run: rank 0 may hold the finished run's checkpoint, which it is about to delete.
        return decision, (found[0] if found else None), None

    def _start_or_resume(self) -> None:
        decision, state, path = self._resume_decision()
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
        if decision == RESUME:
            self._check_precision(state.get("precision"))
        if decision == FRESH:
            self._save()  # step 0: a rollback target, and the MLflow run id on disk

    def _check_precision(self, saved: str | None) -> None:
        """Warn (and re-tag the MLflow run) when a resume trains in another precision than the checkpoint."""
        if saved is None or saved == self.precision.name:
            return
        logger.warning(
            "the checkpoint was trained in %s, this run trains in %s (%s): the steps from %d on differ "
            "from an uninterrupted run", saved, self.precision.name, self.precision.reason, self.progress.global_step,
        )
        if self.tracker:
            self.tracker.set_tags({
                "precision": self.precision.name,
                "precision_reason": self.precision.reason,
                "precision_changed": f"{saved} -> {self.precision.name} at step {self.progress.global_step}",
            })

    # ---------------------------------------------------------------- the loop
    def _loader(self) -> torch.utils.data.DataLoader:
        config = self.config
        self.batches.start_at(self.progress.epoch, self.progress.step_in_epoch)
        workers = config.num_workers
        return torch.utils.data.DataLoader(
            self.dataset,
            sampler=self.batches,
            batch_size=None,
            collate_fn=pack_batch,
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

    def _should_stop(self) -> bool:
        """Read by :func:`train_step` right before its all-reduce: True makes the step in flight the last."""
        return self._stop_requested

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
                micro_batches.append(unpack_batch(batch))
            waited = time.perf_counter() - wait_start
            item = micro_batches[0]["item"]
            step_number = self.progress.global_step + 1
            result = train_step(
                self.ddp_model, micro_batches, micro_batches[0]["step_tokens"], self.optimizer, self.scaler,
                self.precision, config.max_grad_norm, self.dist, self.device,
                inject_nonfinite=step_number in config.inject_nonfinite_steps,
                stop_requested=self._should_stop, seed=self.seed,
            )
            self.scheduler.step()
            elapsed = time.perf_counter() - wait_start
            watchdog.beat()
            self.progress.global_step = step_number
            self.progress.epoch = item.epoch
            self.progress.step_in_epoch = item.step_in_epoch + 1
            self.guard.observe(step_number, result.finite, result.loss, result.grad_norm, list(item.step_cut_ids))
            self._record(result, waited, elapsed)
            improved = False
            if config.validate_every_steps and step_number % config.validate_every_steps == 0:
                improved = self._validate(watchdog)
            # No periodic or best checkpoint inside a streak of skipped steps: the newest
            # checkpoint stays a good rollback target. A stop saves regardless.
            in_streak = self.guard.consecutive > 0
            if result.stop or (not in_streak and (improved or step_number % config.checkpoint_every_steps == 0)):
                self._save()
            if result.stop:
                return False

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

    def _validate(self, watchdog: StallWatchdog) -> bool:
        """Dev loss of the current weights, logged; True when it beats the best so far (then best.pt follows)."""
        if not self.dev_batches:
            return False
        loss = dev_loss(
            self.ddp_model, self.dev_dataset, self.dev_batches, self.precision, self.dist, self.device, watchdog.beat
        )
        watchdog.beat()
        self.progress.last_dev_loss = loss
        self.progress.last_dev_step = self.progress.global_step
        if self.tracker:
            self.tracker.record(self.progress.global_step, {"dev/loss": loss})
        logger.info("step %d: dev loss %.4f", self.progress.global_step, loss)
        return loss < self.progress.best_dev_loss

    def _good_checkpoint(self) -> tuple[dict, Path] | None:
        """The newest readable checkpoint taken outside a streak of non-finite steps (rank 0 looks)."""
        directory = self.paths.checkpoint_dir
        target = ckpt.checkpoint_path(directory, self.progress.good_step)
        for path in [target, *(path for path in ckpt.list_checkpoints(directory) if path != target)]:
            try:
                state = ckpt.load_checkpoint(path)
            except Exception as error:  # missing, truncated or corrupt: try the next one
                logger.warning("cannot roll back to %s (%s); trying an older checkpoint", path, error)
                continue
            if int(state["guard"].get("consecutive", 0)) == 0:
                return state, path
        return None

    def _rollback(self) -> None:
        rollbacks = self.guard.rollbacks + 1
        found = self._share_checkpoint(self._good_checkpoint() if self.dist.is_main else None)
        if found is None:
            raise AsrflowError("non-finite steps and no checkpoint to roll back to")
        state, path = found
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
            # The abandoned steps are trained again: their buffered points must not reach MLflow.
            self.tracker.discard_after(self.progress.global_step)
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
        weights, choice = self._final_weights(recent)
        cmvn = cmvn_stats(load_cmvn(self.cmvn_path))
        run_id = self.tracker.run_id if self.tracker else None
        save_bundle(
            self.paths.model_path, weights, self.model_config, self.tokenizer, self.features, cmvn, run_id,
            info={**summary, "averaged": [path.name for path in recent], **choice},
        )
        with atomic_path(self.paths.loss_csv) as tmp, open(tmp, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["step", "loss"])
            for step, loss in zip(self.progress.history["step"], self.progress.history["loss"], strict=True):
                writer.writerow([step, f"{loss:.6f}"])
        if self.tracker:
            final_metrics = {"train/final_best_dev_loss": self.progress.best_dev_loss}
            final_metrics.update({f"final/{key}": value for key, value in choice.items() if key.startswith("dev_loss")})
            self.tracker.record(self.progress.global_step, final_metrics)
            self.tracker.flush()
            self.tracker.log_artifact(self.paths.model_path, artifact_path="model")
            self.tracker.log_artifact(self.paths.lang_dir / MODEL_FILE, artifact_path="tokenizer")
            self._log_params_artifact()
            self.tracker.log_artifact(self.paths.loss_csv, artifact_path="plots")
        return summary

    def _final_weights(self, recent: list[Path]) -> tuple[dict[str, torch.Tensor], dict]:
        """The bundle's weights: the average of ``recent`` checkpoints or the last weights, whichever has
        the lower dev loss (the average on a tie or without dev data); and what was chosen, with both losses.
        """
        averaged = ckpt.average_model_states(recent)
        names = ", ".join(path.name for path in recent)
        if not self.dev_batches:
            logger.info("final model: average of %s (no dev data to compare it with the last weights)", names)
            return averaged, {"final_weights": "average"}
        last = {name: tensor.detach().cpu().clone() for name, tensor in self.model.state_dict().items()}
        losses = {"dev_loss_average": self._dev_loss_of(averaged), "dev_loss_last": self._dev_loss_of(last)}
        choice = "average" if losses["dev_loss_average"] <= losses["dev_loss_last"] else "last"
        logger.info(
            "final model: %s weights (dev loss %.4f for the average of %s, %.4f for the last weights)",
            choice, losses["dev_loss_average"], names, losses["dev_loss_last"],
        )
        return (averaged if choice == "average" else last), {"final_weights": choice, **losses}

    def _dev_loss_of(self, weights: dict[str, torch.Tensor]) -> float:
        """Dev loss (nats per token) of ``weights`` in this process alone (rank 0, no collectives)."""
        model = copy.deepcopy(self.model)  # a copy, not build_model: no draw from the torch RNG
        model.load_state_dict(weights)
        return dev_loss(model, self.dev_dataset, self.dev_batches, self.precision, DistInfo(), self.device)

    def _log_params_artifact(self) -> None:
        """The params this run was given (``all_params``) as ``params/params.yaml`` in the MLflow run."""
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "params.yaml"
            path.write_text(yaml.safe_dump(self.all_params, sort_keys=False))
            self.tracker.log_artifact(path, artifact_path="params")

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
                # Flushes points past the last checkpoint too: a resume skips the steps already logged.
                self.tracker.end(status)
            shutdown_distributed()
