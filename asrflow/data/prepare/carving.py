"""Carving dev and test out of train, without holding train in memory.

Utterances are carved in whole *groups* so that a speaker (or a recording) never lands in
two splits. The group of an utterance is, at the first level that gives enough groups:

1. its **speaker**, when every kept train utterance names one;
2. its **recording** (segments of one recording stay together);
3. the **utterance** itself (all of train comes from too few recordings).

"Enough" means at least one group per carved split plus one left for train. The rule,
for a split with target share ``fraction`` of the n kept train utterances:

* k = max(1, round(fraction * n)) utterances (Python's ``round``, half to even);
* the groups are ordered by a hash of ``(seed, group key)`` (BLAKE2b, 8 bytes), ties by
  key; whole groups move to the carved split in that order until it holds at least k
  utterances, always leaving at least one group in train;
* ``dev`` is carved first (``seed``), then ``test`` (``seed + 1``) from what remains.

What is held while train streams by: one count per speaker, one per recording (about 120
bytes each), and the utterance ids only while all of train comes from at most three
recordings (the only case where the utterance level can be needed). The same corpus,
params and seed always give the same split.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asrflow.errors import AsrflowError

if TYPE_CHECKING:
    from lhotse import SupervisionSegment

LEVELS = ("speaker", "recording", "utterance")
#: At most dev and test are carved.
MAX_CARVED = 2


def group_hash(seed: int, key: str) -> int:
    """The 64-bit hash that orders groups (stable across runs and machines)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}\x1f{key}".encode(), digest_size=8).digest(), "big")


def pick_groups(groups: dict[str, int], fraction: float, seed: int) -> set[str]:
    """The group keys to move out of train (the rule of this module's docstring).

    Args:
        groups: group key -> number of utterances in it.
        fraction: the share of utterances to move, in [0, 1).
        seed: orders the groups.
    """
    total = sum(groups.values())
    if total < 2 or fraction <= 0 or len(groups) < 2:
        return set()
    target = max(1, round(fraction * total))
    order = sorted(groups, key=lambda key: (group_hash(seed, key), key))
    moved: set[str] = set()
    count = 0
    for key in order[:-1]:
        if count >= target:
            break
        moved.add(key)
        count += groups[key]
    return moved


@dataclass(kw_only=True)
class GroupCounter:
    """Counts the kept train utterances per speaker and per recording as they stream by."""

    speakers: Counter = field(default_factory=Counter)
    recordings: Counter = field(default_factory=Counter)
    utterances: int = 0
    all_have_speakers: bool = True
    few_recording_ids: list[str] | None = field(default_factory=list)

    def add(self, utterance_id: str, recording_id: str, speaker: str | None) -> None:
        """Count one kept train utterance."""
        self.utterances += 1
        self.recordings[recording_id] += 1
        if speaker:
            self.speakers[speaker] += 1
        else:
            self.all_have_speakers = False
        if self.few_recording_ids is not None:
            if len(self.recordings) > MAX_CARVED + 1:
                self.few_recording_ids = None
            else:
                self.few_recording_ids.append(utterance_id)

    def level(self, needed: int) -> str:
        """The grouping level (:data:`LEVELS`) that gives at least ``needed`` groups, else ``utterance``."""
        if self.all_have_speakers and len(self.speakers) >= needed:
            return "speaker"
        if len(self.recordings) >= needed:
            return "recording"
        return "utterance"

    def groups(self) -> int:
        """How many groups the level for two carved splits would give (the most that exists)."""
        level = self.level(3)
        if level == "speaker":
            return len(self.speakers)
        if level == "recording":
            return len(self.recordings)
        return self.utterances


@dataclass(frozen=True)
class CarvePlan:
    """Which train utterances go to dev and test.

    Attributes:
        level: the grouping level used (:data:`LEVELS`).
        moved: carved split -> the group keys it takes (utterance ids at level ``utterance``).
    """

    level: str
    moved: dict[str, set[str]]

    def split_of(self, utterance_id: str, recording_id: str, speaker: str | None) -> str:
        """Where one kept train utterance goes: ``train``, ``dev`` or ``test``."""
        key = {"speaker": speaker, "recording": recording_id}.get(self.level, utterance_id)
        for split, keys in self.moved.items():
            if key in keys:
                return split
        return "train"


def plan_carving(counter: GroupCounter, fractions: dict[str, float], seed: int) -> CarvePlan:
    """The carve plan for the splits in ``fractions`` (``dev`` then ``test``)."""
    level = counter.level(len(fractions) + 1)
    if level == "speaker":
        groups = dict(counter.speakers)
    elif level == "recording":
        groups = dict(counter.recordings)
    else:
        groups = dict.fromkeys(counter.few_recording_ids or (), 1)
    moved: dict[str, set[str]] = {}
    for offset, (split, fraction) in enumerate(fractions.items()):
        keys = pick_groups(groups, fraction, seed + offset)
        moved[split] = keys
        for key in keys:
            del groups[key]
    return CarvePlan(level, moved)


def carve_ids(supervisions: Iterable[SupervisionSegment], fraction: float, seed: int) -> set[str]:
    """The ids of the utterances that this module's rule moves out of train for one split.

    Args:
        supervisions: the kept train utterances.
        fraction: the share to move, in [0, 1).
        seed: orders the groups.
    """
    supervisions = list(supervisions)
    counter = GroupCounter()
    for supervision in supervisions:
        counter.add(supervision.id, supervision.recording_id, supervision.speaker)
    plan = plan_carving(counter, {"dev": fraction}, seed)
    return {s.id for s in supervisions if plan.split_of(s.id, s.recording_id, s.speaker) == "dev"}


def check_carvable(counter: GroupCounter, carved: list[str], name: str | None = None) -> None:
    """Refuse a carve that would leave a split empty (before any manifest is written)."""
    groups = counter.groups()
    if carved and groups < len(carved) + 1:
        which = f"corpus {name}'s " if name else ""
        raise AsrflowError(
            f"cannot carve {' and '.join(carved)} from {which}train: train holds {counter.utterances} usable "
            f"utterance(s) in {groups} group(s), and each carved split needs one group with one left for train "
            f"(at least {len(carved) + 1}); add data, or name the corpus' {' and '.join(carved)} split(s) "
            "in prepare.splits"
        )
