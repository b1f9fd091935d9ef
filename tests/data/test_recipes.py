"""Every Lhotse recipe (issue 13, item 3): how each must be called, what each returns, and
asrflow's handling of each shape, with small fake corpora for the real ljspeech (one
unsplit pair) and librispeech (several parts per split) recipes, and a recipe that needs
``output_dir`` and returns lazy manifests read from it."""

from __future__ import annotations

import inspect
from pathlib import Path

import lhotse.recipes
import numpy as np
import pytest
import soundfile as sf
from lhotse import CutSet, Recording, RecordingSet, SupervisionSegment, SupervisionSet

from asrflow.data.prepare.config import PrepareConfig
from asrflow.data.prepare.corpus import prepare_corpus
from asrflow.data.prepare.importers.recipes import UNSPLIT, recipe_call, recipe_names, recipe_splits, run_recipe
from asrflow.errors import AsrflowError

ALL_RECIPES = recipe_names()


def _tone(path: Path, seconds: float, rate: int = 16000) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    t = np.arange(int(seconds * rate)) / rate
    sf.write(path, (0.2 * np.sin(2 * np.pi * 220.0 * t)).astype(np.float32), rate)
    return path


def test_every_installed_recipe_is_classified_and_asks_for_what_it_needs():
    """Walk every ``prepare_*``: the parameter that takes corpus_dir, whether output_dir is
    required, and the other required arguments, which an empty recipe_args names exactly."""
    assert len(ALL_RECIPES) > 50
    kinds = {"required": [], "optional": [], "none": []}
    for name in ALL_RECIPES:
        call = recipe_call(name)
        parameters = inspect.signature(getattr(lhotse.recipes, f"prepare_{name}")).parameters
        assert call.corpus_parameter in parameters, name
        kinds[call.output_dir].append(name)
        if call.required:
            with pytest.raises(AsrflowError, match=f"prepare_{name} needs {', '.join(call.required)}: set them"):
                call.check_args({})
        call.check_args(dict.fromkeys(call.required, "x"))  # complete: accepted
        with pytest.raises(AsrflowError, match="not accepted"):
            call.check_args({"no_such_argument_anywhere": 1} if not call.takes_any else {"output_dir": 1})
    # The shapes the issue lists are all present in the installed Lhotse.
    assert {"commonvoice", "gigaspeech", "spgispeech"} <= set(kinds["required"])
    assert recipe_call("speechcommands").corpus_parameter == "corpus_dir"  # not its first parameter
    assert recipe_call("tedlium").corpus_parameter == "tedlium_root"
    assert "speechcommands_version" in recipe_call("speechcommands").required


def test_return_shapes_are_named_splits():
    pair = {"recordings": RecordingSet.from_recordings([]), "supervisions": SupervisionSet.from_segments([])}
    assert list(recipe_splits("x", {"train": pair, "dev": pair, "skip": None})) == ["train", "dev"]
    assert list(recipe_splits("x", pair)) == [UNSPLIT]
    assert list(recipe_splits("x", (pair["recordings"], pair["supervisions"]))) == [UNSPLIT]
    assert list(recipe_splits("x", {"en": {"train": pair, "test": pair}, "pl": {"train": pair}})) == [
        "en/train",
        "en/test",
        "pl/train",
    ]
    with pytest.raises(AsrflowError, match="returned str"):
        recipe_splits("x", "nonsense")


def _ljspeech(root: Path, count: int) -> Path:
    lines = []
    for i in range(count):
        utt = f"LJ001-{i:04d}"
        _tone(root / "wavs" / f"{utt}.wav", 0.5 + 0.05 * i, rate=22050)
        lines.append(f"{utt}|Word number {i}.|word number {i}")
    (root / "metadata.csv").write_text("\n".join(lines) + "\n")
    return root


def test_unsplit_recipe_carves_dev_and_test_from_it(tmp_path):
    corpus = _ljspeech(tmp_path / "LJSpeech", 20)
    base = {"corpus": "ljspeech", "corpus_dir": str(corpus), "dev_fraction": 0.1, "test_fraction": 0.2}
    with pytest.raises(
        AsrflowError,
        match=r"one unsplit set \(no split names\); set prepare.splits to "
        r"\{train: all, dev: null, test: null\}",
    ):
        prepare_corpus(PrepareConfig.from_section(base), tmp_path / "out", seed=1)
    assert not (tmp_path / "out").exists()
    config = PrepareConfig.from_section({**base, "splits": {"train": UNSPLIT, "dev": None, "test": None}})
    summary = prepare_corpus(config, tmp_path / "out", seed=1)
    assert {name: s.utterances for name, s in summary.splits.items()} == {"train": 14, "dev": 2, "test": 4}
    assert summary.splits["test"].carved_from_train and summary.splits["dev"].carved_from_train
    ids = [
        cut.id
        for split in ("train", "dev", "test")
        for cut in CutSet.from_file(tmp_path / "out" / f"{split}_cuts.jsonl.gz")
    ]
    assert sorted(ids) == [f"LJ001-{i:04d}" for i in range(20)]


def test_a_train_too_small_to_carve_is_refused_by_name(tmp_path):
    corpus = _ljspeech(tmp_path / "LJSpeech", 2)
    config = PrepareConfig.from_section(
        {"corpus": "ljspeech", "corpus_dir": str(corpus), "splits": {"train": UNSPLIT, "dev": None, "test": None}}
    )
    with pytest.raises(
        AsrflowError,
        match=r"cannot carve dev and test from train: train holds 2 usable "
        r"utterance\(s\) in 2 group\(s\).*at least 3",
    ):
        prepare_corpus(config, tmp_path / "out", seed=1)
    assert not (tmp_path / "out").exists()
    zero = PrepareConfig.from_section(
        {
            "corpus": "ljspeech",
            "corpus_dir": str(corpus),
            "test_fraction": 0.0,
            "splits": {"train": UNSPLIT, "dev": "all2", "test": None},
        }
    )
    with pytest.raises(AsrflowError, match="gives one unsplit set"):
        prepare_corpus(zero, tmp_path / "out", seed=1)


def _librispeech(root: Path) -> Path:
    corpus = root / "LibriSpeech"
    parts = {
        "train-clean-100": ("19", "198"),
        "train-clean-360": ("26", "495"),
        "dev-clean": ("84", "121"),
        "test-clean": ("61", "70"),
    }
    for part, (speaker, chapter) in parts.items():
        folder = corpus / part / speaker / chapter
        lines = []
        for index in range(2):
            utt = f"{speaker}-{chapter}-{index:04d}"
            _tone(folder / f"{utt}.flac", 0.5 + 0.1 * index)
            lines.append(f"{utt} {part.upper().replace('-', ' ')} LINE {index}")
        (folder / f"{speaker}-{chapter}.trans.txt").write_text("\n".join(lines) + "\n")
    return corpus


def test_recipe_with_several_parts_per_split(tmp_path):
    corpus = _librispeech(tmp_path)
    config = PrepareConfig.from_section(
        {
            "corpus": "librispeech",
            "corpus_dir": str(corpus),
            "splits": {"train": ["train-clean-100", "train-clean-360"], "dev": "dev-clean", "test": "test-clean"},
        }
    )
    summary = prepare_corpus(config, tmp_path / "out", seed=1)
    assert {name: s.utterances for name, s in summary.splits.items()} == {"train": 4, "dev": 2, "test": 2}
    wrong = PrepareConfig.from_section(
        {
            "corpus": "librispeech",
            "corpus_dir": str(corpus),
            "splits": {"train": "train-other-500", "dev": None, "test": "test-clean"},
        }
    )
    with pytest.raises(
        AsrflowError, match="gives the splits dev-clean, test-clean, train-clean-100, train-clean-360; pick from those"
    ):
        prepare_corpus(wrong, tmp_path / "out2", seed=1)


def prepare_lazyfake(corpus_dir, output_dir, languages="auto"):
    """A recipe shaped like commonvoice: ``output_dir`` required, nested ``lang -> split``,
    and lazy manifests that read from ``output_dir`` (what broke when it was removed first)."""
    corpus_dir, output_dir = Path(corpus_dir), Path(output_dir)
    result = {}
    for split in ("train", "dev", "test"):
        recordings, supervisions = [], []
        for path in sorted((corpus_dir / "en" / split).glob("*.wav")):
            recording = Recording.from_file(path)
            recordings.append(recording)
            supervisions.append(
                SupervisionSegment(
                    recording.id, recording.id, 0.0, recording.duration, channel=0, text=f"say {recording.id}"
                )
            )
        RecordingSet.from_recordings(recordings).to_file(output_dir / f"rec_{split}.jsonl.gz")
        SupervisionSet.from_segments(supervisions).to_file(output_dir / f"sup_{split}.jsonl.gz")
        result[split] = {
            "recordings": RecordingSet.from_jsonl_lazy(output_dir / f"rec_{split}.jsonl.gz"),
            "supervisions": SupervisionSet.from_jsonl_lazy(output_dir / f"sup_{split}.jsonl.gz"),
        }
    return {"en": result}


def test_output_dir_recipe_with_lazy_manifests(tmp_path, monkeypatch):
    monkeypatch.setattr(lhotse.recipes, "prepare_lazyfake", prepare_lazyfake, raising=False)
    for split, count in (("train", 4), ("dev", 1), ("test", 1)):
        for i in range(count):
            _tone(tmp_path / "cv" / "en" / split / f"{split}{i}.wav", 0.6)
    assert recipe_call("lazyfake").output_dir == "required"
    assert sorted(run_recipe("lazyfake", tmp_path / "cv", {})) == ["en/dev", "en/test", "en/train"]
    config = PrepareConfig.from_section(
        {
            "corpus": "lazyfake",
            "corpus_dir": str(tmp_path / "cv"),
            "splits": {"train": "en/train", "dev": "en/dev", "test": "en/test"},
        }
    )
    summary = prepare_corpus(config, tmp_path / "out", seed=1)
    assert {name: s.utterances for name, s in summary.splits.items()} == {"train": 4, "dev": 1, "test": 1}


def test_a_failing_recipe_is_one_clear_error(tmp_path):
    config = PrepareConfig.from_section(
        {"corpus": "ljspeech", "corpus_dir": str(tmp_path), "splits": {"train": UNSPLIT, "dev": None, "test": None}}
    )
    with pytest.raises(AsrflowError, match=r"lhotse recipe prepare_ljspeech failed on .*metadata.csv"):
        prepare_corpus(config, tmp_path / "out", seed=1)
    assert not (tmp_path / "out").exists()
    needs = PrepareConfig.from_section(
        {"corpus": "tedlium", "corpus_dir": str(tmp_path), "recipe_args": {"no_such": 1}}
    )
    with pytest.raises(AsrflowError, match=r"\['no_such'\] not accepted by lhotse.recipes.prepare_tedlium"):
        prepare_corpus(needs, tmp_path / "out", seed=1)
