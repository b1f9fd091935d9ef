"""The run's final weights: the average of the last checkpoints or the last weights, by dev loss."""

from __future__ import annotations

import copy
import csv
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

from asrflow.data.features.cmvn import cmvn_stats, load_cmvn
from asrflow.files import atomic_path
from asrflow.serving.bundle import save_bundle
from asrflow.tokenizer import MODEL_FILE
from asrflow.training import checkpoint as ckpt
from asrflow.training.config import TrainPaths
from asrflow.training.distributed import DistInfo
from asrflow.training.precision import PrecisionPolicy
from asrflow.training.run_state import LossHistory

logger = logging.getLogger(__name__)


def final_weights(
    last: dict[str, torch.Tensor],
    recent: list[Path],
    dev_loss_of: Callable[[dict[str, torch.Tensor]], float] | None,
) -> tuple[dict[str, torch.Tensor], dict]:
    """The bundle's weights and what was chosen.

    Args:
        last: the model's current weights (detached CPU copies).
        recent: checkpoints whose weights are averaged.
        dev_loss_of: dev loss (nats per token) of a set of weights; None without dev data.
    Returns:
        the average of ``recent`` or ``last``, whichever has the lower dev loss (the average on a tie
        or without dev data), and ``{"final_weights": "average"|"last", "dev_loss_average": ..,
        "dev_loss_last": ..}`` (the losses only with dev data).
    """
    averaged = ckpt.average_model_states(recent)
    names = ", ".join(path.name for path in recent)
    if dev_loss_of is None:
        logger.info("final model: average of %s (no dev data to compare it with the last weights)", names)
        return averaged, {"final_weights": "average"}
    losses = {"dev_loss_average": dev_loss_of(averaged), "dev_loss_last": dev_loss_of(last)}
    choice = "average" if losses["dev_loss_average"] <= losses["dev_loss_last"] else "last"
    logger.info(
        "final model: %s weights (dev loss %.4f for the average of %s, %.4f for the last weights)",
        choice,
        losses["dev_loss_average"],
        names,
        losses["dev_loss_last"],
    )
    return (averaged if choice == "average" else last), {"final_weights": choice, **losses}


def write_loss_csv(path: Path, history: LossHistory) -> None:
    """``step,loss`` per optimizer step, written whole or not at all."""
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step", "loss"])
        for step, loss in zip(history.steps, history.losses, strict=True):
            writer.writerow([step, f"{loss:.6f}"])


def log_final_run(
    tracker,
    *,
    paths: TrainPaths,
    all_params: dict,
    step: int,
    metrics: dict[str, float],
    register_model_name: str | None,
) -> None:
    """The end of a training run in MLflow: the final ``metrics`` at ``step``; the model bundle, the
    tokenizer, the loss plot and the params the run was given as artifacts; the bundle as the run's
    MLflow model (a ``pyfunc``), registered under ``register_model_name`` when set."""
    tracker.record(step, metrics)
    tracker.flush()
    tracker.log_artifact(paths.model_path, artifact_path="model")
    tracker.log_artifact(paths.lang_dir / MODEL_FILE, artifact_path="tokenizer")
    tracker.log_artifact(paths.loss_csv, artifact_path="plots")
    with tempfile.TemporaryDirectory() as folder:
        params_file = Path(folder) / "params.yaml"
        params_file.write_text(yaml.safe_dump(all_params, sort_keys=False))
        tracker.log_artifact(params_file, artifact_path="params")
    tracker.log_model(paths.model_path, registered_model_name=register_model_name, step=step)


def write_final_model(
    *,
    model: torch.nn.Module,
    model_shape: dict,
    features,
    data,
    recent: list[Path],
    precision: PrecisionPolicy,
    history: LossHistory,
    summary: dict,
    paths: TrainPaths,
    tracker,
    all_params: dict,
    register_model_name: str | None,
) -> None:
    """Rank 0, after the final checkpoint: the model bundle (the average of the ``recent`` checkpoints or
    ``model``'s weights, by dev loss in ``precision``), the loss plot from ``history``, and the run's end
    in MLflow.

    ``model_shape`` (:func:`~asrflow.model.conformer_ctc.shape_record`), ``features`` and ``data`` (a
    :class:`~asrflow.training.train_data.TrainData`: the tokenizer and CMVN) go into the bundle with ``summary``.
    """
    last = {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}
    device = next(model.parameters()).device
    dev_loss_of = alone_dev_loss(model, data, precision, device) if data.dev_batches else None
    weights, choice = final_weights(last, recent, dev_loss_of)
    save_bundle(
        paths.model_path,
        model_state=weights,
        model_shape=model_shape,
        tokenizer=data.tokenizer,
        features=features,
        cmvn=cmvn_stats(load_cmvn(data.cmvn_path)),
        run_id=tracker.run_id,
        info={**summary, "averaged": [path.name for path in recent], **choice},
    )
    write_loss_csv(paths.loss_csv, history)
    final = {f"final/{key}": value for key, value in choice.items() if key.startswith("dev_")}
    log_final_run(
        tracker,
        paths=paths,
        all_params=all_params,
        step=summary["steps"],
        metrics={"train/final_best_dev_loss": summary["best_dev_loss"], **final},
        register_model_name=register_model_name,
    )


def alone_dev_loss(model: torch.nn.Module, data, precision, device: torch.device) -> Callable[[dict], float]:
    """Dev loss (nats per token) of a set of weights for ``model``'s shape, in this process alone (rank 0,
    no collectives)."""

    def dev_loss_of(weights: dict[str, torch.Tensor]) -> float:
        copy_ = copy.deepcopy(model)  # a copy, not build_model: no draw from the torch RNG
        copy_.load_state_dict(weights)
        return data.dev_loss(copy_, precision=precision, dist=DistInfo(), device=device)

    return dev_loss_of
