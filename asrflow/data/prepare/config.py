"""The ``prepare`` section of ``params.yaml`` (:class:`PrepareConfig`) and its checks.

**Splits.** ``prepare.splits`` maps our split (``train``, ``dev``, ``test``) to the
corpus' split name: a recipe's key (``train-clean-100``), a TSV's name, or a Kaldi folder.
A list of names merges them (``train: [train-clean-100, train-clean-360]``). ``train``
must be named; ``dev`` or ``test`` left empty (``null``, or left out) is *carved* from
train after validation (:mod:`asrflow.data.prepare.carving`). ``test`` may name several
test sets, each scored on its own by ``evaluate`` (:meth:`PrepareConfig.test_sources`).

**Several corpora** (``prepare.corpora``): each entry is a mapping with a ``name`` and any
keys of the section; a key left out takes the section's value
(:meth:`PrepareConfig.corpus_configs`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from asrflow.data.manifests import CORPUS_NAME, check_test_set_name
from asrflow.data.prepare.text import TextConfig
from asrflow.errors import AsrflowError
from asrflow.params import build_config, require_mapping

#: Our split names, in the order they are read and validated.
SPLITS = ("train", "dev", "test")
#: Accepted values of ``prepare.long_utterances``.
LONG_UTTERANCE_MODES = ("drop", "split")
#: Values of ``prepare.corpus`` that are not Lhotse recipes.
OWN_FORMATS = ("folder", "kaldi")
#: features settings, which one entry of ``prepare.corpora`` may not set (every corpus shares them).
FEATURE_KEYS = frozenset({"sampling_rate", "num_mel_bins", "frame_shift_s", "frame_length_s", "on_the_fly"})


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    """The ``prepare`` section of ``params.yaml`` (see the comments there).

    Attributes:
        corpus: a Lhotse recipe name, ``folder`` or ``kaldi``.
        corpus_dir: the corpus folder (relative to the working directory, or absolute).
        recipe_args: extra keyword arguments for the Lhotse recipe.
        splits: our split -> the corpus' split name(s), or ``None`` to carve it from train;
            ``test`` may also name several test sets (:meth:`test_sources`).
        dev_fraction: share of train utterances carved into dev when it is empty, in [0, 1).
        test_fraction: share of train utterances carved into test when it is empty, in [0, 1).
        min_duration_s: shorter utterances are rejected (seconds).
        max_duration_s: longer utterances are dropped or split (seconds).
        long_utterances: ``drop`` or ``split``.
        channel: ``mix`` or a channel index for multi-channel audio.
        max_rejected_fraction: the stage fails above this share of rejected items.
        allow_commands: run the commands of a Kaldi ``wav.scp`` (entries ending in ``|``) to read
            their audio; off, they are rejected (``piped_command``), as a data file that runs
            commands is code.
        text: transcript normalisation settings.
        corpora: several corpora, prepared together (:meth:`corpus_configs`), or ``None`` for the one
            the keys above describe.
    """

    corpus: str = "yesno"
    corpus_dir: str = "data/corpora/yesno"
    recipe_args: dict[str, Any] = field(default_factory=dict)
    splits: dict[str, Any] = field(default_factory=lambda: {"train": "train", "dev": None, "test": "test"})
    dev_fraction: float = 0.1
    test_fraction: float = 0.1
    min_duration_s: float = 0.1
    max_duration_s: float = 30.0
    long_utterances: str = "drop"
    channel: str | int = "mix"
    max_rejected_fraction: float = 0.05
    allow_commands: bool = False
    text: TextConfig = field(default_factory=TextConfig)
    corpora: list[Any] | None = None

    @classmethod
    def from_section(cls, section: dict[str, Any] | None) -> PrepareConfig:
        """Build and check the config from the ``prepare`` section of ``params.yaml``.

        Raises:
            AsrflowError: an unknown key, a wrong type, or a value out of range.
        """
        section = dict(require_mapping(section, "prepare"))
        section["text"] = build_config(TextConfig, section.pop("text", None), "prepare.text")
        config = build_config(cls, section, "prepare")
        config.corpus_configs()  # checks prepare.corpora
        return config

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> AsrflowError:
            value = getattr(self, key)
            return AsrflowError(f"params.yaml: prepare.{key} = {value!r} {why}")

        if not self.corpus.strip():
            raise bad("corpus", "is empty; name a Lhotse recipe, or use folder or kaldi")
        if not 0.0 <= self.dev_fraction < 1.0:
            raise bad("dev_fraction", "must be in [0, 1)")
        if not 0.0 <= self.test_fraction < 1.0:
            raise bad("test_fraction", "must be in [0, 1)")
        if self.dev_fraction + self.test_fraction >= 1.0:
            raise bad("test_fraction", f"plus dev_fraction ({self.dev_fraction}) must be below 1")
        if not 0.0 <= self.max_rejected_fraction <= 1.0:
            raise bad("max_rejected_fraction", "must be in [0, 1]")
        if self.min_duration_s < 0:
            raise bad("min_duration_s", "must be >= 0")
        if self.max_duration_s <= self.min_duration_s:
            raise bad("max_duration_s", f"must be greater than min_duration_s = {self.min_duration_s}")
        if self.long_utterances not in LONG_UTTERANCE_MODES:
            raise bad("long_utterances", f"must be one of {', '.join(LONG_UTTERANCE_MODES)}")
        if (
            isinstance(self.channel, str)
            and self.channel != "mix"
            or (isinstance(self.channel, int) and self.channel < 0)
        ):
            raise bad("channel", "must be 'mix' or a channel index >= 0")
        self.split_sources()  # checks prepare.splits

    def split_sources(self) -> dict[str, list[str]]:
        """Each split to write -> the corpus' split names it merges (an empty list: carve it from train).

        The keys are ``train``, ``dev``, then the test sets in the order ``splits.test``
        gives them (see :meth:`test_sources`).

        Raises:
            AsrflowError: when ``splits`` has an unknown key, no train, a bad value, or
            names one corpus split for two of ours.
        """
        unknown = sorted(set(self.splits) - set(SPLITS))
        if unknown:
            raise AsrflowError(
                f"params.yaml: prepare.splits has unknown key(s) {', '.join(unknown)}; use {', '.join(SPLITS)}"
            )
        sources = {
            split: _source_names(self.splits.get(split), f"prepare.splits.{split}") for split in ("train", "dev")
        }
        sources.update(self.test_sources())
        owner: dict[str, str] = {}
        for split, names in sources.items():
            for name in names:
                if name in owner:
                    raise AsrflowError(
                        f"params.yaml: prepare.splits names {name!r} for both {owner[name]} and {split}; "
                        "give each split its own data (or null to carve it from train)"
                    )
                owner[name] = split
        if not sources["train"]:
            raise AsrflowError("params.yaml: prepare.splits.train must name the corpus' training split")
        return sources

    def test_sources(self) -> dict[str, list[str]]:
        """Each test set's name -> the corpus' split names it merges, from ``splits.test``.

        ``null`` carves one test set, ``test``, from train; a name (or a list merged into
        one) is the one test set ``test``; a list gives one test set per name, named after
        it; a mapping names each test set itself
        (``{clean: test-clean, noisy: [test-other, dev-other]}``, a list merging its names).

        Raises:
            AsrflowError: a value of another shape, or a name a test set cannot have.
        """
        value = self.splits.get("test")
        if isinstance(value, dict):
            if not value:
                raise AsrflowError("params.yaml: prepare.splits.test = {} names no test set; give one, or null")
            return {
                check_test_set_name(name, "params.yaml: prepare.splits.test"): _source_names(
                    names, f"prepare.splits.test.{name}", required=True
                )
                for name, names in value.items()
            }
        if isinstance(value, list) and value:
            names = _source_names(value, "prepare.splits.test")
            hint = "; a list names each test set after its split: to name them yourself, use a mapping {name: split}"
            for name in names:
                check_test_set_name(name, "params.yaml: prepare.splits.test", hint)
            return {name: [name] for name in names}
        return {"test": _source_names(value, "prepare.splits.test")}

    def corpus_configs(self) -> list[tuple[str | None, PrepareConfig]]:
        """Each corpus to prepare: its name (``None`` for the one corpus of the plain form) and its config.

        ``prepare.corpora`` lists corpora as mappings with a ``name`` and any keys of the
        ``prepare`` section (``corpus``, ``corpus_dir``, ``splits``, ``text``, ...); a key left
        out takes the section's value. The ``corpus_listing`` stage lists each entry's ``corpus_dir``
        (prepare's dependency, ``stages/corpus_listing.py``).

        Raises:
            AsrflowError: a name that is missing, repeats or cannot prefix ids, a weight or a
            features setting in an entry, or a bad value.
        """
        if not self.corpora:
            return [(None, self)]
        base = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("corpora", "text")}
        configs: list[tuple[str | None, PrepareConfig]] = []
        for number, entry in enumerate(self.corpora):
            where = f"params.yaml: prepare.corpora[{number}]"
            if not isinstance(entry, dict):
                raise AsrflowError(f"{where} = {entry!r} must be a mapping with a name and the keys of prepare")
            entry = dict(entry)
            name = entry.pop("name", None)
            if not isinstance(name, str) or not CORPUS_NAME.fullmatch(name):
                raise AsrflowError(
                    f"{where}: name = {name!r}; each corpus needs a name of letters, digits, '.', '_' and '-'"
                )
            where = f"{where} ({name})"
            if name in dict(configs):
                raise AsrflowError(f"params.yaml: prepare.corpora names {name!r} twice; give each corpus its own name")
            if "weight" in entry:
                raise AsrflowError(
                    f"{where}: weight belongs to training, where a change re-runs only the train stage: "
                    f"set train.data.corpus_weights: {{{name}: {entry['weight']!r}}}"
                )
            shared = sorted(set(entry) & FEATURE_KEYS)
            if shared:
                raise AsrflowError(
                    f"{where}: {', '.join(shared)} is a features setting, shared by every corpus (each is "
                    f"resampled to features.sampling_rate); set it in the features section"
                )
            if "corpora" in entry:
                raise AsrflowError(f"{where}: a corpus cannot list corpora")
            text = entry.pop("text", None)
            if text is not None:
                text = {**dataclasses.asdict(self.text), **require_mapping(text, f"{where}.text")}
            text = build_config(TextConfig, text, f"prepare.corpora[{number}].text") if text else self.text
            try:
                config = build_config(PrepareConfig, {**base, **entry, "text": text}, f"prepare.corpora[{number}]")
            except AsrflowError as error:  # a check of PrepareConfig names the key, not the entry
                raise AsrflowError(f"{where}: {str(error).removeprefix('params.yaml: ')}") from None
            configs.append((name, config))
        return configs


def _source_names(value: Any, key: str, *, required: bool = False) -> list[str]:
    """A ``prepare.splits`` value as the list of corpus split names it merges (``[]``: null, carve it)."""
    names = [value] if isinstance(value, str) else [] if value is None and not required else value
    if not (isinstance(names, list) and all(isinstance(n, str) and n.strip() for n in names)) or required and not names:
        shapes = "a split name or a list of names" if required else "a split name, a list of names, or null"
        raise AsrflowError(f"params.yaml: {key} = {value!r} must be {shapes}")
    return names
