"""asrflow's side: the real Trainer (MLflow, data workers, SpecAugment, guards), stopped after the timed steps."""

from __future__ import annotations

import time
from pathlib import Path

from bench.common import on_device, train_until
from bench.peer.side import report, run_as_child


def train(options: dict, launched: float) -> dict:
    import torch

    from asrflow.logs import setup_logging
    from asrflow.training.distributed import DistInfo
    from asrflow.training.settings import TrainingSettings
    from asrflow.training.step import ctc_loss_sum

    setup_logging()  # the Trainer's stamped lines in the side's log: where its start goes (bench.startup.MARKERS)
    settings = TrainingSettings.from_params(options["params"])  # the side's params, features and seed included
    data, exp, max_steps, steps = Path(options["data"]), Path(options["exp"]), options["max_steps"], []

    def timing(result) -> bool:
        steps.append({"t": time.time(), "audio_s": result.audio_seconds})
        return max_steps is not None and len(steps) >= max_steps - 1

    trainer = train_until(data, exp, settings, after_step=timing)
    model, loss, device = trainer.model, None, trainer.device
    if options["dev"]:
        loss = trainer.data.dev_loss(model, precision=trainer.precision, dist=DistInfo(), device=device)
    batch = on_device(torch.load(Path(options["batches"]) / "step-0.pt", weights_only=True), device)
    model.train()

    def forward_backward():
        log_probs, out_lens = model(batch["features"], batch["feature_lens"])
        ctc_loss_sum(log_probs, out_lens, batch).backward()

    optim = settings.train.optim
    shown = {"num_threads": optim.num_threads, "num_workers": settings.run.num_workers, "precision": optim.precision}
    return report(model, forward_backward, batch, steps=steps, launched=launched, dev_loss=loss, settings=shown)


if __name__ == "__main__":
    run_as_child(train)
