"""An asrflow model bundle as an MLflow model: a ``pyfunc`` that transcribes audio.

:func:`log_bundle` logs ``exp/model.pt`` as a MLflow 3 ``LoggedModel`` of a run (the UI's
Models tab and the run's Model column), with its signature, its pip requirements, the
``asrflow`` package's code, and optionally a registered version. Then::

    model = mlflow.pyfunc.load_model("models:/<model_id>")      # or runs:/<run_id>/model
    model.predict(pd.DataFrame({"path": ["a.wav", "b.flac"]}))  # -> transcript column
    model.predict(pd.DataFrame({"waveform": [samples], "sample_rate": [16000]}))

    mlflow models serve -m models:/<model_id> --env-manager local -h 127.0.0.1 -p 5001
    curl -d '{"dataframe_records": [{"path": "/data/a.wav"}]}' -H 'Content-Type: application/json' \\
        http://127.0.0.1:5001/invocations

Input rows hold either ``path`` (an audio file any format Lhotse reads) or ``waveform``
(mono samples, floats in [-1, 1]) with ``sample_rate`` (default: the model's). Audio is
resampled to the model's rate. Rows come as a DataFrame or a list of dicts; a plain list of paths
reaches the model with no column (MLflow keeps only the signature's) and is refused with the forms
that work. A bad input (that, a missing or unreadable file, a row with neither column) raises
:class:`BadInput` naming it, which ``mlflow models serve`` answers with a 400 and the same message. Output: one
``transcript`` per row, in order. The ``decoder`` param picks ``greedy``
(default) or ``beam``; ``$ASRFLOW_DEVICE`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``) where the encoder runs.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import mlflow
import mlflow.pyfunc
from mlflow.exceptions import MlflowException
from mlflow.models import Model, ModelSignature
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.types import ColSpec, DataType, ParamSchema, ParamSpec, Schema
from mlflow.types.schema import Array

from asrflow.errors import AsrflowError

logger = logging.getLogger("asrflow.serving.pyfunc")
MODEL_TYPE = "speech-recognition"

#: Name of the logged model (and its folder in a run's artifacts).
MODEL_NAME = "model"
#: Key of the bundle file among the model's artifacts.
BUNDLE_ARTIFACT = "bundle"
#: Distributions the model needs at serving time, pinned to the versions that logged it.
REQUIREMENTS = (
    "torch",
    "torchaudio",
    "lhotse",
    "lilcom",
    "sentencepiece",
    "soundfile",
    "numpy",
    "pandas",
    "mlflow",
    "pyyaml",
)
#: Seconds of audio per decoding batch.
BATCH_SECONDS = 60.0

SIGNATURE = ModelSignature(
    inputs=Schema(
        [
            ColSpec(DataType.string, "path", required=False),
            ColSpec(Array(DataType.double), "waveform", required=False),
            ColSpec(DataType.long, "sample_rate", required=False),
        ]
    ),
    outputs=Schema([ColSpec(DataType.string, "transcript")]),
    params=ParamSchema([ParamSpec("decoder", DataType.string, "greedy")]),
)


def pip_requirements() -> list[str]:
    """``name==version`` of :data:`REQUIREMENTS` as installed here (CPU/GPU builds keep their base version)."""
    pins = []
    for name in REQUIREMENTS:
        try:
            version = importlib.metadata.version(name).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
        pins.append(f"{name}=={version}")
    return pins


def _missing(value: Any) -> bool:
    if value is None:
        return True
    try:
        return bool(value != value)  # NaN, as pandas fills an absent column
    except (TypeError, ValueError):
        return False


#: What predict says of an input that reaches it with no column at all. MLflow keeps only the columns the
#: signature names, so a plain list of paths (one unnamed column) arrives as a frame with no rows.
NO_KNOWN_COLUMN = (
    "the input has none of the columns path, waveform, sample_rate (MLflow drops what the signature does not "
    "name, so a plain list of paths arrives empty): pass pd.DataFrame({'path': [...]}), a list of "
    "{'path': ...} dicts, or rows of 'waveform' samples with their 'sample_rate'"
)


class BadInput(MlflowException, AsrflowError):
    """An input the model cannot transcribe (a missing or unreadable file, a row with neither column): still an
    :class:`AsrflowError`, and an ``INVALID_PARAMETER_VALUE`` that MLflow's scoring server answers with a 400 and
    this message (any other exception from ``predict`` gets its generic "unexpected error" text)."""

    def __init__(self, message: str):
        super().__init__(message, error_code=INVALID_PARAMETER_VALUE)


class AsrflowTranscriber(mlflow.pyfunc.PythonModel):
    """The pyfunc: audio files or waveforms in, transcripts out (see the module docstring)."""

    def load_context(self, context) -> None:
        from asrflow.serving.bundle import load_bundle
        from asrflow.serving.device import resolve_device

        # A CUDA GPU when the serving machine has one ($ASRFLOW_DEVICE: cpu, cuda or cuda:N to choose).
        device = resolve_device(os.environ.get("ASRFLOW_DEVICE", "auto"), "$ASRFLOW_DEVICE")
        self.bundle = load_bundle(context.artifacts[BUNDLE_ARTIFACT], device=device)
        self._decoders: dict[str, Any] = {}

    def _decoder(self, kind: str):
        from asrflow.decoding.ctc import build_decoder
        from asrflow.tokenizer import BLANK_ID

        if kind not in self._decoders:
            self._decoders[kind] = build_decoder(
                kind,
                tokens=self.bundle.tokenizer.pieces,
                blank=BLANK_ID,
                beam_size=8,
                lm_path=None,
                lm_weight=0.5,
                word_score=0.0,
            )
        return self._decoders[kind]

    def predict(self, context, model_input, params: dict[str, Any] | None = None):
        """One ``transcript`` per input row; :class:`BadInput` (an :class:`AsrflowError`) naming what is wrong
        with the input, every unreadable file at once."""
        import pandas as pd

        try:
            if isinstance(model_input, pd.DataFrame) and len(model_input.columns) == 0:
                raise AsrflowError(NO_KNOWN_COLUMN)
            rows = _rows(model_input)
            decode = self._decoder((params or {}).get("decoder") or "greedy")
            with tempfile.TemporaryDirectory(prefix="asrflow-pyfunc-") as folder:
                paths = [
                    _audio_path(row, index, Path(folder), self.bundle.features.sampling_rate)
                    for index, row in enumerate(rows)
                ]
                transcripts = transcribe(self.bundle, paths, decode)
        except AsrflowError as error:
            raise BadInput(str(error)) from None
        return pd.DataFrame({"transcript": transcripts})


def transcribe(bundle, paths: list[str], decode, batch_seconds: float = BATCH_SECONDS) -> list[str]:
    """Transcripts of audio files, in order, in batches of at most ``batch_seconds`` sorted by duration.

    Raises:
        AsrflowError: before any decoding, naming every file that cannot be read or is too short, one
            ``;``-separated reason each.
    """
    from asrflow.data.manifests import pack_shortest_first
    from asrflow.serving.inference import read_audio, transcripts

    cuts, problems = [], []
    for cut, message in read_audio(paths):
        cuts.append(cut)
        if message is not None:
            problems.append(message)
    if problems:
        raise AsrflowError("; ".join(problems))
    texts = [""] * len(cuts)
    for batch in pack_shortest_first(range(len(cuts)), lambda index: cuts[index].duration, batch_seconds):
        for index, text in zip(batch, transcripts(bundle, [cuts[index] for index in batch], decode), strict=True):
            texts[index] = text
    return texts


def _rows(model_input) -> list[dict[str, Any]]:
    """The input as a list of row dicts: a DataFrame, a list of paths or dicts, or one path."""
    import pandas as pd

    if isinstance(model_input, pd.DataFrame):
        return model_input.to_dict(orient="records")
    if isinstance(model_input, str):
        return [{"path": model_input}]
    if isinstance(model_input, dict):
        return pd.DataFrame(model_input).to_dict(orient="records")
    rows = []
    for item in model_input:
        rows.append({"path": item} if isinstance(item, str | Path) else dict(item))
    return rows


def _audio_path(row: dict[str, Any], index: int, folder: Path, model_rate: int) -> str:
    """The row's audio file: its ``path``, or its ``waveform`` written as a WAV file in ``folder``."""
    import numpy as np
    import soundfile

    path, waveform = row.get("path"), row.get("waveform")
    if not _missing(path):
        return str(path)
    if waveform is None or (not isinstance(waveform, list | tuple | np.ndarray) and _missing(waveform)):
        raise AsrflowError(f"input row {index}: give 'path' (an audio file) or 'waveform' (samples)")
    samples = np.asarray(waveform, dtype=np.float32)
    if samples.ndim != 1 or samples.size == 0:
        raise AsrflowError(f"input row {index}: 'waveform' must be a non-empty list of mono samples")
    rate = row.get("sample_rate")
    rate = model_rate if _missing(rate) else int(rate)
    if rate <= 0:
        raise AsrflowError(f"input row {index}: 'sample_rate' must be above 0, got {rate}")
    target = folder / f"row{index}.wav"
    soundfile.write(target, samples, rate, subtype="FLOAT")
    return str(target)


def log_bundle(
    bundle_path: str | Path,
    *,
    run_id: str,
    tracking_uri: str,
    experiment_id: str | None = None,
    name: str = MODEL_NAME,
    registered_model_name: str | None = None,
    step: int = 0,
) -> Any:
    """Log the bundle at ``bundle_path`` as run ``run_id``'s MLflow model; returns MLflow's ``ModelInfo``.

    The model is built from code (:mod:`asrflow.serving.pyfunc_code`, nothing pickled) and
    carries the bundle, the ``asrflow`` package (``code/``), :data:`SIGNATURE` and
    :func:`pip_requirements`; it is linked to the run (with the run's metrics at
    ``step`` copied to it), in the run's experiment (``experiment_id``, else the run's: left to
    itself MLflow puts it in the Default experiment). ``registered_model_name``: also register a
    version under it.
    """
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    bundle_path = Path(bundle_path)
    if not bundle_path.is_file():
        raise AsrflowError(f"model file {bundle_path} not found: train a model first")
    package = Path(__file__).resolve().parents[1]  # the whole asrflow package travels with the model
    with _use_tracking_uri(tracking_uri):
        run = mlflow.MlflowClient(tracking_uri).get_run(run_id)
        model = mlflow.initialize_logged_model(
            name=name,
            source_run_id=run_id,
            params=run.data.params,
            model_type=MODEL_TYPE,
            experiment_id=experiment_id or run.info.experiment_id,
        )
        info = Model.log(
            model_id=model.model_id,
            artifact_path=None,
            name=name,
            flavor=mlflow.pyfunc,
            run_id=run_id,
            python_model=str(Path(__file__).resolve().with_name("pyfunc_code.py")),
            artifacts={BUNDLE_ARTIFACT: str(bundle_path.resolve())},
            code_paths=[str(package)],
            signature=SIGNATURE,
            pip_requirements=pip_requirements(),
            registered_model_name=registered_model_name,
            step=step,
        )
    logger.info("logged MLflow model %s (%s)", info.model_id, info.model_uri, extra={"terminal": True})
    return info
