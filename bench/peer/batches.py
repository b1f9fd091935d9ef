"""asrflow's planned, augmented batches written to disk, one file per step, for both sides to train on."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

KEYS = ("features", "feature_lens", "targets", "target_lens", "durations", "step_tokens")


def dump_batches(data: Path, out: Path, settings, *, max_steps: int | None, written_steps: int | None = None) -> dict:
    """``out/step-<k>.pt`` for each training step ``settings`` (TrainingSettings, one batch per step) plans (only the
    first ``written_steps`` when given: the rest are counted) and ``out/dev-<k>.pt`` for each dev batch; returns
    ``{"steps", "vocab_size"}``."""
    import torch

    from asrflow.data.loading.planner import BatchItem
    from bench.common import bench_train_data as build_train_data

    out.mkdir(parents=True, exist_ok=True)
    train_data = build_train_data(data, settings, accum_grad=1)
    steps = 0
    for item in train_data.batches:
        if written_steps is None or steps < written_steps:
            batch = train_data.dataset[item]
            torch.save({key: batch[key] for key in KEYS}, out / f"step-{steps}.pt")
        steps += 1
        if max_steps is not None and steps >= max_steps:
            break
    for index, ids in enumerate(train_data.dev_batches):
        item = BatchItem(epoch=0, step_in_epoch=0, micro_index=0, batch_index=index, cut_ids=ids, step_cut_ids=ids)
        batch = train_data.dev_dataset[item]
        torch.save({key: batch[key] for key in KEYS}, out / f"dev-{index}.pt")
    return {"steps": steps, "vocab_size": train_data.tokenizer.vocab_size}


def cached_batches(work: Path, name: str, params_file: Path, *, data: Path, dump) -> tuple[Path, dict]:
    """The folder of :func:`dump_batches` (``dump(folder)``), cached per params content and data folder."""
    key = hashlib.sha256(params_file.read_bytes() + str(data).encode()).hexdigest()[:10]
    folder = work / f"peer-batches-{name}-{key}"
    if not (folder / ".done").is_file():
        shutil.rmtree(folder, ignore_errors=True)
        (folder / ".done").parent.mkdir(parents=True, exist_ok=True)
        info = dump(folder)
        (folder / ".done").write_text(json.dumps(info))
    return folder, json.loads((folder / ".done").read_text())
