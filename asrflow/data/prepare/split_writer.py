"""Writing one split's manifests as cuts stream by, in Lhotse's ``jsonl.gz`` format.

:func:`utterance_cut` makes the cut of one kept utterance (what
``CutSet.from_manifests(...).trim_to_supervisions(keep_overlapping=False)`` gives for
it); :class:`SplitWriter` takes such cuts, as JSON lines sorted by id, and writes
``{split}_cuts.jsonl.gz`` and ``{split}_supervisions.jsonl.gz`` at once, and
``{split}_recordings.jsonl.gz`` (each recording once, sorted by id) through a
:class:`~asrflow.data.prepare.spool.SortedSpool` at :meth:`SplitWriter.close`. Memory: one spool
chunk. gzip headers carry no time stamp and no file name (byte-reproducible output).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, BinaryIO

from lhotse import Recording, SupervisionSegment
from lhotse.cut import MonoCut, MultiCut
from lhotse.utils import fastcopy

from asrflow.data.prepare.spool import DEFAULT_CHUNK_LINES, SortedSpool

#: Recording ids :class:`SplitWriter` remembers to skip spooling a recording again.
RECENT_RECORDINGS = 1024


def utterance_cut(recording: Recording, supervision: SupervisionSegment) -> MonoCut | MultiCut:
    """The cut of one utterance: the supervision's span of the recording, on its channel(s).

    Its id is the supervision's id; it holds that one supervision, shifted to start at 0.
    """
    kind = MultiCut if isinstance(supervision.channel, list) else MonoCut
    return kind(
        id=supervision.id,
        start=supervision.start,
        duration=supervision.duration,
        channel=supervision.channel,
        recording=recording,
        supervisions=[fastcopy(supervision, start=0.0)],
    )


def recording_dict(recording: Recording) -> dict[str, Any]:
    """``recording.to_dict()``, built directly for the plain case (file sources, no transforms)."""
    if recording.transforms is not None or any(source.video is not None for source in recording.sources):
        return recording.to_dict()
    fields = {
        "id": recording.id,
        "sources": [
            _non_null(type=source.type, channels=list(source.channels), source=source.source)
            for source in recording.sources
        ],
        "sampling_rate": recording.sampling_rate,
        "num_samples": recording.num_samples,
        "duration": recording.duration,
        "channel_ids": list(recording.channel_ids) if recording.channel_ids is not None else None,
    }
    return _non_null(**fields)


def cut_dict(recording: dict[str, Any], supervision: SupervisionSegment) -> dict[str, Any]:
    """``utterance_cut(recording, supervision).to_dict()``, given ``recording_dict(recording)``."""
    shifted = fastcopy(supervision, start=0.0)
    if supervision.alignment is None:
        names = [f.name for f in dataclasses.fields(SupervisionSegment)]
        shifted = _non_null(**{name: getattr(shifted, name) for name in names})
    else:
        shifted = shifted.to_dict()
    kind = "MultiCut" if isinstance(supervision.channel, list) else "MonoCut"
    return {
        "id": supervision.id,
        "start": supervision.start,
        "duration": supervision.duration,
        "channel": supervision.channel,
        "supervisions": [shifted],
        "recording": recording,
        "type": kind,
    }


def _non_null(**fields: Any) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if value is not None}


def portable(recording: Recording, cwd: Path) -> Recording:
    """File paths under ``cwd`` written relative to it (so manifests survive moving the repository)."""
    sources = []
    for source in recording.sources:
        path = Path(source.source) if source.type == "file" else None
        if path is not None and path.is_absolute():
            normalised = Path(os.path.normpath(path))
            if normalised.is_relative_to(cwd):
                source = fastcopy(source, source=normalised.relative_to(cwd).as_posix())
        sources.append(source)
    return fastcopy(recording, sources=sources)


def open_gzip(path: Path) -> tuple[BinaryIO, gzip.GzipFile]:
    """A gzip stream with no time stamp and no name in its header, and its raw file."""
    raw = open(path, "wb")  # noqa: SIM115 - closed by the caller with the stream
    return raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0)


class SplitWriter:
    """The manifests of one split, written as its cuts arrive sorted by id.

    Attributes:
        utterances: cuts written.
        seconds: their total duration.
        recordings: recordings written (after :meth:`close`).
        sampling_rates: their sampling rates (after :meth:`close`).
        multichannel: how many have more than one channel (after :meth:`close`).
    """

    def __init__(self, folder: Path, split: str, work: Path, *, chunk_lines: int = DEFAULT_CHUNK_LINES) -> None:
        self.folder, self.split = folder, split
        (folder / split).parent.mkdir(parents=True, exist_ok=True)  # a test set named <corpus>/<split>
        self.streams = {kind: open_gzip(folder / f"{split}_{kind}.jsonl.gz") for kind in ("cuts", "supervisions")}
        # '%' is in no split name, so each split's spool has a name of its own in the one work folder
        self.spool = SortedSpool(work, f"{split.replace('/', '%')}_recordings", chunk_lines=chunk_lines)
        self.recent: OrderedDict[str, None] = OrderedDict()
        self.utterances = 0
        self.seconds = 0.0
        self.recordings = 0
        self.sampling_rates: set[int] = set()
        self.multichannel = 0

    def write(self, line: str, cut: dict[str, Any]) -> None:
        """Write one cut: ``line`` is its JSON, ``cut`` the same parsed (``Cut.to_dict()``)."""
        supervision = dict(cut["supervisions"][0], start=cut["start"])
        self.streams["cuts"][1].write((line + "\n").encode("utf-8"))
        self.streams["supervisions"][1].write((_dumps(supervision) + "\n").encode("utf-8"))
        self.utterances += 1
        self.seconds += cut["duration"]
        recording = cut["recording"]
        if recording["id"] not in self.recent:
            self.spool.add(recording["id"], _dumps(recording))
            self.recent[recording["id"]] = None
            if len(self.recent) > RECENT_RECORDINGS:
                self.recent.popitem(last=False)

    def close(self) -> None:
        """Finish the cut and supervision files and write the recordings, each once, sorted by id."""
        for raw, stream in self.streams.values():
            stream.close()
            raw.close()
        raw, stream = open_gzip(self.folder / f"{self.split}_recordings.jsonl.gz")
        with raw, stream:
            last = None
            for rec_id, line in self.spool.drain():
                if rec_id == last:
                    continue
                last = rec_id
                stream.write((line + "\n").encode("utf-8"))
                recording = json.loads(line)
                self.recordings += 1
                self.sampling_rates.add(recording["sampling_rate"])
                self.multichannel += len(recording["channel_ids"]) > 1


def _dumps(item: dict[str, Any]) -> str:
    return json.dumps(item, ensure_ascii=False)
