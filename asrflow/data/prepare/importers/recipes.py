"""The Lhotse recipe importer: run a recipe, keep its manifests between runs, stream them.

**Lhotse recipes** (any other ``corpus`` value ``X``): ``lhotse.recipes.prepare_X(corpus_dir,
**recipe_args)``, called without an output directory (or with a temporary one when the
recipe requires it, read before it is removed). ``corpus_dir`` goes to the recipe's
``corpus_dir`` parameter, or to its first one (``audio_dir``, ``tedlium_root``...); other
parameters without a default must be set in ``recipe_args``. The recipe's result maps its
split names (``train``, ``dev-clean``, ...) to ``{"recordings": ..., "supervisions": ...}``;
nested parts are named with ``/`` (``en/train``); a recipe that returns one unsplit pair
offers it as the split ``all`` (carve dev and test from it: ``splits: {train: all, dev:
null, test: null}``). See :func:`recipe_splits`.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import logging
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lhotse import Recording, RecordingSet, SupervisionSet

from asrflow.data.prepare.importers.common import ImportedSplit, Item
from asrflow.data.prepare.validator import Candidate
from asrflow.errors import AsrflowError, first_line

logger = logging.getLogger(__name__)


def recipe_names() -> list[str]:
    """Names ``X`` of the recipes ``lhotse.recipes.prepare_X`` that Lhotse exposes."""
    import lhotse.recipes

    return sorted(name[len("prepare_") :] for name in dir(lhotse.recipes) if name.startswith("prepare_"))


def find_recipe(name: str) -> Any:
    """The function ``lhotse.recipes.prepare_<name>``.

    Raises:
        AsrflowError: when Lhotse has no such recipe (the message lists some that exist).
    """
    import lhotse.recipes

    function = getattr(lhotse.recipes, f"prepare_{name}", None)
    if function is None and re.fullmatch(r"[A-Za-z0-9_]+", name):
        try:
            module = importlib.import_module(f"lhotse.recipes.{name}")
            function = getattr(module, f"prepare_{name}", None)
        except ImportError:
            function = None
    if not callable(function):
        names = recipe_names()
        close = [n for n in names if n.startswith(name[:3].lower())][:5]
        examples = close or [n for n in ("yesno", "librispeech", "mini_librispeech", "commonvoice") if n in names]
        raise AsrflowError(
            f"params.yaml: prepare.corpus = {name!r} is not a Lhotse recipe nor 'folder' or 'kaldi'; "
            f"valid recipes include {', '.join(examples)} ({len(names)} in all, "
            "see lhotse.recipes); use corpus: folder or kaldi for your own data"
        )
    return function


#: The split name under which a recipe that returns one unsplit pair is offered.
UNSPLIT = "all"


@dataclass(frozen=True, kw_only=True)
class RecipeCall:
    """How ``lhotse.recipes.prepare_<name>`` must be called.

    Attributes:
        corpus_parameter: the parameter that receives ``prepare.corpus_dir``: ``corpus_dir``
            when the recipe has one, else its first parameter (``audio_dir``, ``tedlium_root``...).
        output_dir: ``required``, ``optional`` or ``none``: whether the recipe must be given
            a folder to write its manifests to (it then often returns lazy manifests read from it).
        required: other parameters without a default: they must come from ``prepare.recipe_args``.
        accepted: every parameter ``recipe_args`` may set.
    """

    name: str
    corpus_parameter: str
    output_dir: str
    required: tuple[str, ...]
    accepted: tuple[str, ...]
    takes_any: bool

    def check_args(self, recipe_args: dict[str, Any]) -> None:
        """Refuse ``recipe_args`` (``prepare.recipe_args``) that the recipe does not take, that set what asrflow
        gives it (the corpus folder, the output folder), or that leave a required parameter out: one
        :class:`AsrflowError` naming the keys and what the recipe takes."""
        where = f"lhotse.recipes.prepare_{self.name}"
        own = {self.corpus_parameter, "output_dir"}
        unknown = sorted(key for key in recipe_args if key not in self.accepted and not self.takes_any)
        if unknown or own & set(recipe_args):
            raise AsrflowError(
                f"params.yaml: prepare.recipe_args {unknown or sorted(own & set(recipe_args))} not accepted by "
                f"{where} (prepare.corpus_dir is given as its {self.corpus_parameter}, and asrflow picks the "
                f"output folder); it takes: {', '.join(self.accepted) or 'nothing'}"
            )
        missing = [key for key in self.required if key not in recipe_args]
        if missing:
            raise AsrflowError(
                f"{where} needs {', '.join(missing)}: set them in params.yaml under prepare.recipe_args "
                f"(prepare.corpus_dir is given as its {self.corpus_parameter})"
            )


def recipe_call(name: str, function: Any = None) -> RecipeCall:
    """Classify the recipe's signature (see :class:`RecipeCall`)."""
    function = function or find_recipe(name)
    parameters = inspect.signature(function).parameters
    named = [p for p in parameters.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    corpus = "corpus_dir" if "corpus_dir" in parameters else (named[0].name if named else "")
    output = parameters.get("output_dir")
    output_kind = "none" if output is None else "required" if output.default is inspect.Parameter.empty else "optional"
    required = tuple(
        p.name for p in named if p.default is inspect.Parameter.empty and p.name not in (corpus, "output_dir")
    )
    accepted = tuple(p.name for p in named if p.name not in (corpus, "output_dir"))
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return RecipeCall(
        name=name,
        corpus_parameter=corpus,
        output_dir=output_kind,
        required=required,
        accepted=accepted,
        takes_any=takes_any,
    )


def _is_pair(value: Any) -> bool:
    """A ``{"recordings": <manifest>, ...}`` entry (a manifest, eager or lazy, has ``to_eager``)."""
    return isinstance(value, dict) and hasattr(value.get("recordings"), "to_eager")


def recipe_splits(name: str, manifests: Any) -> dict[str, dict]:
    """The recipe's result as ``{split name: {"recordings", "supervisions"}}``.

    Shapes: split names to pairs (``{"train": {...}, "dev": {...}}``); one unsplit pair
    (``{"recordings": ..., "supervisions": ...}`` or a 2-tuple), offered as :data:`UNSPLIT`;
    nested parts (``{"en": {"train": {...}}}`` or ``{"train": {"part1": {...}}}``), offered
    as ``en/train``, ``train/part1``. Entries that hold no recordings are left out.
    """
    if isinstance(manifests, tuple | list) and len(manifests) == 2:
        manifests = {"recordings": manifests[0], "supervisions": manifests[1]}
    if not isinstance(manifests, dict):
        raise AsrflowError(f"lhotse recipe prepare_{name} returned {type(manifests).__name__}, not manifests")
    if _is_pair(manifests):
        return {UNSPLIT: manifests}
    splits: dict[str, dict] = {}

    def walk(prefix: str, value: Any) -> None:
        if _is_pair(value):
            splits[prefix] = value
        elif isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}/{key}" if prefix else str(key), inner)

    walk("", manifests)
    return splits


def run_recipe(name: str, corpus_dir: Path, recipe_args: dict[str, Any]) -> dict[str, ImportedSplit]:
    """Call ``lhotse.recipes.prepare_<name>`` on ``corpus_dir`` with ``recipe_args``.

    ``corpus_dir`` goes to the recipe's ``corpus_dir`` parameter (or its first one, see
    :class:`RecipeCall`); a recipe that requires ``output_dir`` gets a temporary folder,
    and its (often lazy) manifests are read into memory before that folder is removed.

    Returns:
        The recipe's splits by the recipe's own split names (:func:`recipe_splits`).

    Raises:
        AsrflowError: unknown recipe, a ``recipe_args`` key the recipe does not take or a
        required one missing, or a failure of the recipe (typically the corpus is not laid
        out as it expects).
    """
    function = find_recipe(name)
    call = recipe_call(name, function)
    call.check_args(recipe_args)
    kwargs = dict(recipe_args)
    with tempfile.TemporaryDirectory(prefix="asrflow-recipe-") as scratch:
        if call.output_dir == "required":
            kwargs["output_dir"] = scratch
        try:
            if call.corpus_parameter == "corpus_dir":
                manifests = function(corpus_dir=corpus_dir, **kwargs)
            else:
                manifests = function(corpus_dir, **kwargs)
            splits = {}
            for part, value in recipe_splits(name, manifests).items():
                supervisions = value.get("supervisions")
                if supervisions is None:
                    raise AsrflowError(
                        f"lhotse recipe prepare_{name} gives no transcripts for split {part!r}; "
                        "asrflow needs supervisions with text"
                    )
                # Read now: lazy manifests may live in the scratch folder, removed below.
                splits[part] = ImportedSplit(value["recordings"].to_eager(), supervisions.to_eager())
        except AsrflowError:
            raise
        except Exception as error:  # the recipe's own checks are asserts and assorted errors
            raise AsrflowError(
                f"lhotse recipe prepare_{name} failed on {corpus_dir}: {type(error).__name__}: "
                f"{first_line(error)}; check that corpus_dir holds the corpus laid out as the recipe "
                f"expects (see the docstring of lhotse.recipes.prepare_{name})"
            ) from None
    return splits


# --------------------------------------------------------------------------- recipe manifests, cached and streamed

#: Written into the recipe cache; a different value makes the cache stale.
RECIPE_CACHE_FORMAT = 1
_RECIPE_KEY_FILE = "key.json"


def recipe_cache_key(name: str, corpus_dir: Path, recipe_args: dict[str, Any]) -> dict[str, Any]:
    """What the recipe's output depends on: the recipe, its arguments, Lhotse's version, the corpus listing."""
    import lhotse

    from asrflow.data.prepare.listing import corpus_fingerprint

    return {
        "format": RECIPE_CACHE_FORMAT,
        "recipe": name,
        "recipe_args": recipe_args,
        "lhotse": lhotse.__version__,
        "corpus_dir": str(corpus_dir.resolve()),
        "corpus": corpus_fingerprint(corpus_dir),
    }


def cached_recipe(name: str, corpus_dir: Path, recipe_args: dict[str, Any], cache_dir: Path) -> dict[str, Path]:
    """The recipe's splits as folders of ``recordings.jsonl.gz`` / ``supervisions.jsonl.gz``.

    The recipe runs only when ``cache_dir`` holds no result for the same
    :func:`recipe_cache_key` (another recipe, other arguments, another Lhotse, or any
    file of the corpus added, removed, resized or touched); its result is then written
    there, whole or not at all, with recordings sorted by id and supervisions by
    (recording id, start, id), so that :func:`stream_recipe_split` joins them in one pass.

    Returns:
        The recipe's split name -> its folder in the cache.

    Raises:
        AsrflowError: as :func:`run_recipe`.
    """
    import json

    from asrflow.files import atomic_path

    key = recipe_cache_key(name, corpus_dir, recipe_args)
    key_file = cache_dir / _RECIPE_KEY_FILE
    if key_file.is_file():
        stored = json.loads(key_file.read_text())
        if stored.get("key") == key:
            logger.info(
                "prepare: recipe %s unchanged since its last run; reading its manifests from %s", name, cache_dir
            )
            return {split: cache_dir / folder for split, folder in stored["splits"].items()}
    splits = run_recipe(name, corpus_dir, recipe_args)
    folders = {split: f"part{index:03d}" for index, split in enumerate(sorted(splits))}
    with atomic_path(cache_dir) as tmp:
        tmp.mkdir()
        for split, part in splits.items():
            folder = tmp / folders[split]
            folder.mkdir()
            recordings = sorted(part.recordings, key=lambda r: r.id)
            supervisions = sorted(part.supervisions, key=lambda s: (s.recording_id, s.start, s.id))
            RecordingSet.from_recordings(recordings).to_file(folder / "recordings.jsonl.gz")
            SupervisionSet.from_segments(supervisions).to_file(folder / "supervisions.jsonl.gz")
        (tmp / _RECIPE_KEY_FILE).write_text(json.dumps({"key": key, "splits": folders}, indent=2, sort_keys=True))
    return {split: cache_dir / folder for split, folder in folders.items()}


def stream_recipe_split(folder: Path, split: str) -> Iterator[Item]:
    """Stream one cached recipe split (see :func:`cached_recipe`): a merge join on recording id.

    Holds the supervisions of one recording at a time (to see whether they name different
    channels: two-sided calls keep the recipe's channels).
    """
    from lhotse import load_manifest_lazy

    recordings = iter(load_manifest_lazy(folder / "recordings.jsonl.gz"))
    supervisions = load_manifest_lazy(folder / "supervisions.jsonl.gz")
    current: Recording | None = next(recordings, None)
    for rec_id, group in itertools.groupby(supervisions, key=lambda s: s.recording_id):
        group = list(group)
        while current is not None and current.id < rec_id:
            current = next(recordings, None)
        recording = current if current is not None and current.id == rec_id else None
        channels = {tuple(s.channel) if isinstance(s.channel, list) else s.channel for s in group}
        for supervision in group:
            yield Candidate(supervision=supervision, recording=recording, per_channel=len(channels) > 1)
