"""The model's bare step, front end by front end, against SpeechBrain's model of the same shape.

``python -m bench.front_end [--quick] [--threads N] [--repeats N]``: each candidate front end and SpeechBrain's
model step in turn on one random batch. Record ``front_end`` per model: ``params``,
``front_end_mflop_per_audio_s``, ``audio_s_per_s`` and ``ratio_to_speechbrain``.
"""

from __future__ import annotations

import sys
import time

from asrflow.testing.repo import repo_params
from bench.common import emit, machine, parse_args, ratio, rounded

#: (name, subsampling_channels, subsampling_norm); None channels = (d_model, d_model).
CANDIDATES = [
    ("d_model x2, no norm (asrflow before)", None, False),
    ("[64, 32] norm", (64, 32), True),
    ("[32, 32] norm", (32, 32), True),
    ("[16, 32] norm", (16, 32), True),
    ("[8, 32] norm", (8, 32), True),
]
#: One batch: utterances x frames (10 ms) x mel bins; target tokens per utterance.
BATCH = (8, 600, 80)
TARGET_TOKENS = 20
#: Output classes (blank included) of every model: yesno's BPE size.
VOCAB_SIZE = 13


def _batch(vocab_size: int):
    """Random fbank (N, T, F), lengths (N,), targets (N, U), target lengths (N,); the last utterance is shorter."""
    import torch

    generator = torch.Generator().manual_seed(0)
    count, frames, bins = BATCH
    lengths = torch.full((count,), frames)
    lengths[-1] = frames - 37
    targets = torch.randint(1, vocab_size, (count, TARGET_TOKENS), generator=generator)
    return torch.randn(count, frames, bins, generator=generator), lengths, targets, torch.full((count,), TARGET_TOKENS)


def _stepper(model, batch):
    """A function running one forward + CTC + backward + AdamW step of ``model`` on ``batch``."""
    import torch
    import torch.nn.functional as F

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    features, lengths, targets, target_lengths = batch

    def step() -> None:
        log_probs, out_lengths = model(features, lengths)
        loss = F.ctc_loss(log_probs.transpose(0, 1), targets, out_lengths, target_lengths, zero_infinity=True)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def _front_end_flops(front_end, frames: int) -> float:
    """Training FLOPs of a (N, T, F) -> (N, T', ...) ``front_end`` per audio second, one utterance of ``frames``."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        front_end(torch.randn(1, frames, BATCH[2])).sum().backward()
    return counter.get_total_flops() / (frames / 100)


def models(quick: bool) -> dict[str, tuple[object, float]]:
    """name -> (model, front-end training FLOPs per audio second); SpeechBrain's last when it installs."""
    import torch

    from asrflow.model.conformer_ctc import ModelConfig, build_model
    from asrflow.testing.tiny_config import TINY_MODEL
    from asrflow.training.config import load_train_config
    from bench.peer.install import PEER_DIR, install_peer
    from bench.peer.speechbrain_side import speechbrain_model

    train = load_train_config(repo_params())
    shape = {key: getattr(train, key) for key in ("d_model", "num_heads", "ffn_dim", "num_layers", "conv_kernel_size")}
    shape["dropout"] = train.dropout
    if quick:
        shape.update(TINY_MODEL)
    found: dict[str, tuple[object, float]] = {}
    for name, channels, norm in CANDIDATES[:2] if quick else CANDIDATES:
        torch.manual_seed(0)
        front = {"subsampling_channels": channels, "subsampling_norm": norm}
        model = build_model(ModelConfig(input_dim=BATCH[2], vocab_size=VOCAB_SIZE, **front, **shape))
        found[name] = (model, _front_end_flops(model.subsampling, 1000))
    problem = install_peer()
    if problem is None:
        sys.path.insert(0, str(PEER_DIR))
        torch.manual_seed(0)
        peer = speechbrain_model(shape, BATCH[2], VOCAB_SIZE)
        found["speechbrain 1.1.2"] = (peer, _front_end_flops(peer.cnn, 1000))
    else:
        emit({"benchmark": "front_end", "status": "peer unavailable", "reason": problem})
    return found


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser) -> None:
        parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, params.yaml's)")
        parser.add_argument("--repeats", type=int, default=7, help="timed steps per model (median; default 7)")

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    import torch

    torch.set_num_threads(args.threads)
    out = [emit({"benchmark": "machine", **machine()})]
    built = models(args.quick)
    batch = _batch(VOCAB_SIZE)  # the same batch for every model
    steppers = {name: _stepper(model, batch) for name, (model, _) in built.items()}
    for step in steppers.values():
        step()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for _ in range(2 if args.quick else args.repeats):
        for name, step in steppers.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    audio_s = BATCH[0] * BATCH[1] / 100  # upper bound: the last utterance is 0.37 s shorter
    rates = {name: audio_s / sorted(found)[len(found) // 2] for name, found in times.items()}
    peer = rates.get("speechbrain 1.1.2")
    for name, (model, flops) in built.items():
        record = {"benchmark": "front_end", "status": "ok", "model": name, "threads": args.threads}
        record |= {"params": sum(p.numel() for p in model.parameters() if p.requires_grad)}
        record |= {"front_end_mflop_per_audio_s": rounded(flops / 1e6), "audio_s_per_s": rounded(rates[name])}
        out.append(emit({**record, "ratio_to_speechbrain": rounded(ratio(rates[name], peer)) if peer else None}))
    return out


if __name__ == "__main__":
    main()
