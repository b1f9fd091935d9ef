"""The epoch planner: which cuts each batch of an epoch holds, in which order, and which of
those batches each rank builds, from ``(seed, epoch)`` and the cuts' ids and durations only.

:func:`plan_epoch` makes an epoch's batches (an :class:`EpochPlan`: cut positions in the
id-sorted :class:`~asrflow.data.loading.cut_index.CutIndex` and batch bounds, read as lists of
cut ids):

1. a full permutation of the id-sorted cuts drawn from ``numpy.random.default_rng([seed,
   epoch])``: independent of the manifest's order on disk (so of ``features.num_jobs``);
2. equal-count duration buckets (edges at the duration quantiles of the whole corpus);
3. in each bucket, cuts in permutation order are packed greedily while ``cuts x longest
   <= max_duration_s`` (the padded duration, Lhotse's ``TimeConstraint``), the longest cut counted at
   its length once the frame axis is padded (``train.data.pad_frames_to``, :func:`padded_seconds`);
   a cut longer than ``max_duration_s`` is a batch of its own;
4. the last, partial batch of each bucket is joined to its neighbours' while the result
   still fits (a small corpus would otherwise be mostly partial batches);
5. the batches of all buckets are put in an order drawn from the same generator.

So every stretch of an epoch holds cuts from the whole corpus (global shuffle), and
padding stays that of ``num_buckets`` buckets. With several weighted corpora
(:class:`CorpusMix`), step 1 first picks the cuts the epoch takes (:func:`mix_positions`):
the same planning then runs over them. Materialising a plan costs the same at any
position, so a resume jumps straight to batch ``k`` instead of replaying the epoch through
the data pipeline.

Optimizer step ``s`` of an epoch consumes the ``accum_grad * world_size`` consecutive
planned batches starting at ``s * accum_grad * world_size``; rank ``r`` takes micro-batch
``j`` at offset ``j * world_size + r`` (:func:`rank_items`). Trailing batches that cannot
fill a whole step are dropped (rank 0 logs how many, once per epoch), so every rank runs
the same number of steps and no collective waits. :class:`TrainingBatches` yields a rank's
:class:`BatchItem` for the whole run.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from lhotse import CutSet

from asrflow.data.loading.cut_index import CutIndex, as_index

logger = logging.getLogger(__name__)

#: Cut ids joined at a time while a plan's digest is computed.
DIGEST_CHUNK = 100_000
#: Seconds per feature frame when a caller does not say (Lhotse's fbank default).
FRAME_SHIFT_S = 0.01


def padded_frames(frames, pad_frames_to: int):
    """``frames`` (a count, or an array of counts) rounded up to the next multiple of ``pad_frames_to``: the
    length of a batch's frame axis once padded (``train.data.pad_frames_to``; 1 leaves it as it is)."""
    return -(-frames // pad_frames_to) * pad_frames_to


def padded_seconds(durations, *, pad_frames_to: int, frame_shift_s: float = FRAME_SHIFT_S):
    """Seconds each cut fills in a batch whose frame axis is padded to a multiple of ``pad_frames_to`` frames of
    ``frame_shift_s`` seconds: ``durations`` (seconds, a float or an array) itself when ``pad_frames_to`` is 1,
    else each rounded up to whole padding units. Short cuts gain the most: a batch of them would otherwise hold
    up to half as many frames again as ``max_duration_s`` allows."""
    if pad_frames_to <= 1:
        return durations
    frames = np.rint(np.asarray(durations, dtype=np.float64) / frame_shift_s)
    return padded_frames(frames, pad_frames_to) * frame_shift_s


def bucket_of(durations: np.ndarray, num_buckets: int) -> np.ndarray:
    """``(N,)`` bucket number of each duration: edges at the quantiles, so buckets hold equal counts."""
    if num_buckets <= 1 or len(durations) == 0:
        return np.zeros(len(durations), dtype=np.int64)
    edges = np.quantile(durations, np.linspace(0.0, 1.0, num_buckets + 1)[1:-1])
    return np.searchsorted(edges, durations, side="right").astype(np.int64)


def plan_positions(
    durations: np.ndarray,
    epoch: int,
    *,
    seed: int,
    max_duration_s: float,
    num_buckets: int,
    pad_frames_to: int = 1,
    frame_shift_s: float = FRAME_SHIFT_S,
) -> list[np.ndarray]:
    """The batches of ``epoch`` as arrays of positions into the id-sorted index.

    Args:
        durations: ``(N,)`` seconds, in id order.
        epoch, seed: what the permutation is drawn from.
        max_duration_s: a batch's cuts x its longest cut stays at or below this (seconds).
        num_buckets: duration buckets (capped at ``N // 2``, at least 1).
        pad_frames_to, frame_shift_s: how the batches' frame axis is padded (:func:`padded_seconds`).
    Returns:
        Batches (int64 arrays), in the epoch's order; every position appears exactly once.
    """
    count = len(durations)
    if count == 0:
        return []
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(count)
    buckets = bucket_of(durations, min(num_buckets, max(1, count // 2)))
    order = order[np.argsort(buckets[order], kind="stable")]  # bucket by bucket, permuted inside
    bucket_sorted = buckets[order]
    counted = padded_seconds(durations, pad_frames_to=pad_frames_to, frame_shift_s=frame_shift_s)
    seconds = counted[order].tolist()
    edges = [0, *(np.flatnonzero(np.diff(bucket_sorted)) + 1).tolist(), count]
    starts = []
    for first, end in zip(edges[:-1], edges[1:], strict=True):  # one bucket at a time
        starts.append(first)
        size, longest = 0, 0.0
        for i in range(first, end):
            duration = seconds[i]
            if duration > longest:
                longest = duration
            size += 1
            if size > 1 and size * longest > max_duration_s:  # this cut opens the next batch
                starts.append(i)
                size, longest = 1, duration
    batches = np.split(order, starts[1:])
    batches = _merge_bucket_tails(batches, bucket_sorted[starts].tolist(), counted, max_duration_s)
    return [batches[i] for i in rng.permutation(len(batches))]


def _merge_bucket_tails(
    batches: list[np.ndarray], bucket_ids: list[int], durations: np.ndarray, max_duration_s: float
) -> list[np.ndarray]:
    """Join the last (partial) batches of neighbouring buckets while they fit in ``max_duration_s``.

    Each bucket ends in one partial batch; on a small corpus they would be most batches.
    ``batches`` are bucket by bucket, ``bucket_ids`` the bucket of each.
    """
    last = {bucket: i for i, bucket in enumerate(bucket_ids)}  # the last batch of each bucket
    tails = [i for i in sorted(last.values())]
    merged: list[np.ndarray] = []
    current = None
    for i in tails:
        joined = batches[i] if current is None else np.concatenate([current, batches[i]])
        if current is not None and len(joined) * float(durations[joined].max()) > max_duration_s:
            merged.append(current)
            joined = batches[i]
        current = joined
    if current is not None:
        merged.append(current)
    tail_set = set(tails)
    return [batch for i, batch in enumerate(batches) if i not in tail_set] + merged


class EpochPlan:
    """An epoch's batches, compactly: ``positions`` ``(N,)`` int64, every cut's position in the
    id-sorted ``index`` batch after batch, and ``bounds`` ``(B + 1,)`` int64, batch ``b`` being
    ``positions[bounds[b]:bounds[b + 1]]``. About 8 bytes a cut, whatever the ids.

    Reads like the list of batches it stands for: ``len(plan)``, ``plan[b]`` (the cut ids of
    batch ``b``, a list of ``str``; a slice gives a list of them), iteration, ``==``.
    """

    def __init__(self, index: CutIndex, positions: np.ndarray, bounds: np.ndarray):
        self.index = index
        self.positions = positions
        self.bounds = bounds
        self._digest: str | None = None

    @classmethod
    def from_batches(cls, index: CutIndex, batches: Sequence[np.ndarray]) -> EpochPlan:
        lengths = np.array([len(batch) for batch in batches], dtype=np.int64)
        positions = np.concatenate(batches).astype(np.int64) if batches else np.zeros(0, dtype=np.int64)
        return cls(index, positions, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def batch_positions(self, first: int, end: int | None = None) -> np.ndarray:
        """Positions (into the index) of the cuts of batches ``first`` .. ``end - 1`` (default: ``first`` only)."""
        end = first + 1 if end is None else end
        return self.positions[self.bounds[first] : self.bounds[end]]

    def __getitem__(self, batch: int | slice) -> list[str] | list[list[str]]:
        if isinstance(batch, slice):
            return [self[b] for b in range(*batch.indices(len(self)))]
        if not -len(self) <= batch < len(self):
            raise IndexError(batch)
        return self.index.id_list(self.batch_positions(batch % len(self)))

    def __iter__(self) -> Iterator[list[str]]:
        return (self[b] for b in range(len(self)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EpochPlan) and len(self) == len(other) and self.digest == other.digest

    __hash__ = None  # type: ignore[assignment]

    @property
    def digest(self) -> str:
        """16 hex digits of the batches as cut ids (so equal for the same cuts indexed from any manifest
        order); computed once, on first use: a checkpoint's cost does not grow with the corpus."""
        if self._digest is None:
            digest = hashlib.sha256(np.ascontiguousarray(self.bounds).tobytes())
            ids = self.index.ids
            for first in range(0, len(self.positions), DIGEST_CHUNK):
                digest.update(b"\0".join(ids[self.positions[first : first + DIGEST_CHUNK]].tolist()) + b"\0")
            self._digest = digest.hexdigest()[:16]
        return self._digest


@dataclass(frozen=True, kw_only=True)
class CorpusMix:
    """How an epoch mixes the corpora of a train split (see :func:`mix_positions`).

    Attributes:
        corpus_of: ``(N,)`` int64, the corpus of each cut of the id-sorted index (an index into ``weights``).
        weights: each corpus' weight, > 0: an epoch takes ``round(weight x its cuts)`` of its cuts.
        names: the corpora's names, for messages.
    """

    corpus_of: np.ndarray
    weights: tuple[float, ...]
    names: tuple[str, ...]

    def counts(self) -> list[int]:
        """Cuts of each corpus in the index."""
        return np.bincount(self.corpus_of, minlength=len(self.weights)).tolist()

    def epoch_counts(self) -> list[int]:
        """Cuts of each corpus an epoch takes: ``round(weight x count)``, at least 1 of a corpus that has any."""
        return [max(1 if count else 0, round(w * count)) for w, count in zip(self.weights, self.counts(), strict=True)]


def mix_positions(mix: CorpusMix, seed: int, epoch: int) -> np.ndarray:
    """The cuts an epoch takes, as sorted positions into the index (a position repeats for a weight above 1).

    Corpus ``i`` with ``N_i`` cuts and weight ``w_i`` gives ``k_i = round(w_i x N_i)`` cuts: every
    cut ``floor(k_i / N_i)`` times, and ``k_i mod N_i`` more drawn without replacement, from
    ``numpy.random.default_rng([seed, epoch, i])``. Deterministic for ``(seed, epoch)``, and the
    draw of the extra cuts changes with the epoch, so over epochs each cut is seen in proportion.
    """
    chosen = []
    for number, take in enumerate(mix.epoch_counts()):
        members = np.flatnonzero(mix.corpus_of == number)
        if not len(members):
            continue
        whole, extra = divmod(take, len(members))
        chosen.extend([members] * whole)
        if extra:
            rng = np.random.default_rng([seed, epoch, number])
            chosen.append(np.sort(rng.choice(members, size=extra, replace=False)))
    return np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, dtype=np.int64)


def plan_epoch(
    cuts: CutSet | CutIndex,
    epoch: int,
    *,
    seed: int,
    max_duration_s: float,
    num_buckets: int,
    mix: CorpusMix | None = None,
    pad_frames_to: int = 1,
    frame_shift_s: float = FRAME_SHIFT_S,
) -> EpochPlan:
    """The global batches of ``epoch``: :func:`plan_positions` over the cuts (or over those ``mix``
    takes this epoch, :func:`mix_positions`); identical on every rank and for any order of ``cuts``."""
    index = as_index(cuts)
    sizes = {"max_duration_s": max_duration_s, "num_buckets": num_buckets}
    padding = {"pad_frames_to": pad_frames_to, "frame_shift_s": frame_shift_s}
    if mix is None:
        return EpochPlan.from_batches(index, plan_positions(index.durations, epoch, seed=seed, **sizes, **padding))
    taken = mix_positions(mix, seed, epoch)
    batches = plan_positions(index.durations[taken], epoch, seed=seed, **sizes, **padding)
    return EpochPlan.from_batches(index, [taken[batch] for batch in batches])


def plan_digest(plan: EpochPlan) -> str:
    """A short hash of a plan, stored in checkpoints to check a resume sees the same batches
    (computed once per plan: see :attr:`EpochPlan.digest`)."""
    return plan.digest


def steps_in_plan(plan: EpochPlan, accum_grad: int, world_size: int) -> int:
    """Whole optimizer steps the plan holds."""
    return len(plan) // (accum_grad * world_size)


def dropped_batches(plan: EpochPlan, accum_grad: int, world_size: int) -> int:
    """Trailing batches of the plan that cannot fill a whole optimizer step (not trained this epoch)."""
    return len(plan) - steps_in_plan(plan, accum_grad, world_size) * accum_grad * world_size


@dataclass(frozen=True, kw_only=True)
class BatchItem:
    """One micro-batch to build: where it sits in training, and which cuts it holds."""

    epoch: int
    step_in_epoch: int
    micro_index: int
    batch_index: int  # position in the epoch's global plan
    cut_ids: tuple[str, ...]
    step_cut_ids: tuple[str, ...]  # every cut of this optimizer step, all micro-batches and ranks


def rank_items(
    plan: EpochPlan, epoch: int, *, start_step: int, accum_grad: int, world_size: int, rank: int
) -> Iterator[BatchItem]:
    """This rank's micro-batches from optimizer step ``start_step`` to the end of the epoch, made
    as they are drawn (an epoch's items are never all held)."""
    group = accum_grad * world_size
    for step in range(start_step, steps_in_plan(plan, accum_grad, world_size)):
        step_cut_ids = tuple(plan.index.id_list(plan.batch_positions(step * group, (step + 1) * group)))
        for micro in range(accum_grad):
            index = step * group + micro * world_size + rank
            yield BatchItem(
                epoch=epoch,
                step_in_epoch=step,
                micro_index=micro,
                batch_index=index,
                cut_ids=tuple(plan[index]),
                step_cut_ids=step_cut_ids,
            )


#: Epoch plans :class:`TrainingBatches` keeps.
PLAN_CACHE_SIZE = 2


class TrainingBatches:
    """This rank's micro-batches from ``(start_epoch, start_step)`` to the last epoch.

    Iterable, so one ``DataLoader`` (and one set of workers) serves the whole run; each
    epoch's plan is made when the loader first reaches it. ``mix`` weighs several corpora.
    """

    def __init__(
        self,
        cuts: CutSet | CutIndex,
        *,
        seed: int,
        max_duration_s: float,
        num_buckets: int,
        accum_grad: int,
        world_size: int,
        rank: int,
        start_epoch: int,
        start_step: int,
        num_epochs: int,
        mix: CorpusMix | None = None,
        pad_frames_to: int = 1,
        frame_shift_s: float = FRAME_SHIFT_S,
    ):
        self.cuts = as_index(cuts)
        self.mix = mix
        self.pad_frames_to = pad_frames_to
        self.frame_shift_s = frame_shift_s
        self.seed = seed
        self.max_duration_s = max_duration_s
        self.num_buckets = num_buckets
        self.accum_grad = accum_grad
        self.world_size = world_size
        self.rank = rank
        self.start_epoch = start_epoch
        self.start_step = start_step
        self.num_epochs = num_epochs
        self._cached: dict[int, EpochPlan] = {}

    def start_at(self, epoch: int, step: int) -> None:
        """Make the next iteration begin at optimizer step ``step`` of ``epoch`` (a resume or a rollback)."""
        self.start_epoch, self.start_step = epoch, step

    def plan(self, epoch: int) -> EpochPlan:
        """The global plan of ``epoch`` (the two latest are cached: a checkpoint of the
        previous epoch's end and the loader's current epoch do not rebuild each other's)."""
        if epoch not in self._cached:
            if len(self._cached) >= PLAN_CACHE_SIZE:
                del self._cached[next(iter(self._cached))]
            self._cached[epoch] = plan_epoch(
                self.cuts,
                epoch,
                seed=self.seed,
                max_duration_s=self.max_duration_s,
                num_buckets=self.num_buckets,
                mix=self.mix,
                pad_frames_to=self.pad_frames_to,
                frame_shift_s=self.frame_shift_s,
            )
        return self._cached[epoch]

    def __iter__(self) -> Iterator[BatchItem]:
        for epoch in range(self.start_epoch, self.num_epochs):
            start = self.start_step if epoch == self.start_epoch else 0
            plan = self.plan(epoch)
            self._log_dropped(epoch, plan)
            yield from rank_items(
                plan, epoch, start_step=start, accum_grad=self.accum_grad, world_size=self.world_size, rank=self.rank
            )

    def _log_dropped(self, epoch: int, plan: EpochPlan) -> None:
        """Rank 0 says how many trailing batches ``epoch`` drops (none: nothing logged)."""
        dropped = dropped_batches(plan, self.accum_grad, self.world_size)
        if dropped and self.rank == 0:
            logger.info(
                "epoch %d: %d of %d planned batches dropped (they cannot fill a whole step of "
                "accum_grad %d x %d processes)",
                epoch,
                dropped,
                len(plan),
                self.accum_grad,
                self.world_size,
            )
