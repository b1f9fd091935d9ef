"""Lhotse cut manifests described as MLflow datasets (the UI's Dataset column).

A :class:`ManifestDataset` names one split's ``<split>_cuts.jsonl.gz``: its source is the
file, its digest the SHA-256 of the file's *decompressed* content (gzip headers carry a
time stamp, so the compressed bytes of identical manifests differ), and its profile the
number of utterances and hours of audio. :func:`log_manifests`
logs them as run inputs with the context ``train``, ``dev`` or ``test``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from mlflow.data.meta_dataset import MetaDataset
from mlflow.data.sources import LocalArtifactDatasetSource

from asrflow.data.index import MANIFEST_DIGEST_CHARS, manifest_facts
from asrflow.errors import AsrflowError

#: Hex characters of a manifest digest (MLflow's dataset digest column holds 36).
DIGEST_CHARS = MANIFEST_DIGEST_CHARS
#: Dataset input tag MLflow's UI shows as the dataset's context.
DATASET_CONTEXT_TAG = "mlflow.data.context"
_READ_BYTES = 1 << 20


def manifest_digest(path: str | Path) -> str:
    """SHA-256 (first :data:`DIGEST_CHARS` hex characters) of a manifest's decompressed content
    (the train manifest's comes from its index, which hashed it while reading it)."""
    path = Path(path)
    known = manifest_facts(path)
    if known is not None and known["digest"]:
        return known["digest"]
    digest = hashlib.sha256()
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            while block := handle.read(_READ_BYTES):
                digest.update(block)
    except (OSError, EOFError) as error:
        raise AsrflowError(f"cannot read manifest {path} ({error}); run the stage that writes it again") from None
    return digest.hexdigest()[:DIGEST_CHARS]


def combined_digest(digests: Iterable[str]) -> str:
    """One digest for several manifests (order matters): the run's data digest."""
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()[:DIGEST_CHARS]


def manifest_profile(path: str | Path) -> dict[str, Any]:
    """``{"utterances": n, "hours": h}`` of a cut manifest (read lazily, in constant memory; the train
    manifest's from its index)."""
    from lhotse import CutSet

    known = manifest_facts(path)
    if known is not None:
        return {"utterances": known["utterances"], "hours": known["hours"]}

    utterances = 0
    seconds = 0.0
    try:
        for cut in CutSet.from_jsonl_lazy(path):
            utterances += 1
            seconds += cut.duration
    except (OSError, EOFError, ValueError, KeyError) as error:
        raise AsrflowError(f"cannot read manifest {path} ({error}); run the stage that writes it again") from None
    return {"utterances": utterances, "hours": round(seconds / 3600, 4)}


class ManifestDataset(MetaDataset):
    """One split's cut manifest as an MLflow dataset (metadata only: the data stays in place)."""

    def __init__(self, path: str | Path, name: str | None = None):
        path = Path(path)
        if not path.is_file():
            raise AsrflowError(f"manifest {path} not found: run the stage that writes it first")
        self.path = path.resolve()
        self._profile = manifest_profile(path)
        super().__init__(
            source=LocalArtifactDatasetSource(str(self.path)),
            name=name or path.name.removesuffix(".jsonl.gz"),
            digest=manifest_digest(path),
        )

    @property
    def profile(self) -> dict[str, Any]:
        """Utterances and hours of audio."""
        return dict(self._profile)

    def to_dict(self) -> dict[str, str]:
        config = super().to_dict()
        config["profile"] = json.dumps(self._profile)
        return config


def log_manifests(client: Any, run_id: str, manifests: Mapping[str, Any]) -> dict[str, ManifestDataset]:
    """Log manifests (context -> path or :class:`ManifestDataset`) as run ``run_id``'s dataset inputs; a
    dataset the run already has in that context is not logged again. Returns context -> dataset."""
    from mlflow.entities import DatasetInput, InputTag

    datasets = {
        context: item if isinstance(item, ManifestDataset) else ManifestDataset(item, name=context)
        for context, item in manifests.items()
    }
    run = client.get_run(run_id)
    logged = {
        (item.dataset.name, item.dataset.digest, tag.value)
        for item in (run.inputs.dataset_inputs if run.inputs else [])
        for tag in item.tags
        if tag.key == DATASET_CONTEXT_TAG
    }
    inputs = [
        DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag(DATASET_CONTEXT_TAG, context)])
        for context, dataset in datasets.items()
        if (dataset.name, dataset.digest, context) not in logged
    ]
    if inputs:
        client.log_inputs(run_id, datasets=inputs)
    return datasets
