"""Decoding real-time factor of greedy and beam search on the yesno test split.

``python -m bench.decode_rtf [--quick] [--workdir DIR]``: the evaluate stage's decoding with each decoder, with
``exp/model.pt`` (else a model trained here, or with ``--quick`` an untrained one). Record ``decode_rtf``:
``rtf_greedy``, ``rtf_beam`` and ``rtf_encoder`` (features + encoder alone), their ratios, ``wer``.
"""

from __future__ import annotations

import shutil
import statistics
import time
from dataclasses import replace
from pathlib import Path

from bench.common import emit, parse_args, ratio, train_settings, train_until, workdir, write_bundle
from tests.support.corpora import yesno_data
from tests.support.repo import REPO, repo_params

REPEATS = {"full": 3, "quick": 1}
#: Epochs of the fallback model (when exp/model.pt is missing), full mode.
FALLBACK_EPOCHS = 5


def model_bundle(data: Path, work: Path, quick: bool) -> tuple[Path, str]:
    """A model file to decode with, and where it came from: exp/model.pt, else params.yaml's model untrained
    (``quick``) or trained here on yesno for :data:`FALLBACK_EPOCHS` epochs."""
    from asrflow.errors import AsrflowError
    from asrflow.serving.bundle import load_bundle

    try:
        load_bundle(REPO / "exp" / "model.pt")
        return Path(shutil.copyfile(REPO / "exp" / "model.pt", work / "decode-model.pt")), "exp/model.pt"  # a snapshot
    except AsrflowError:
        pass
    params = repo_params()
    if quick:
        return write_bundle(work / "decode-model-untrained.pt", data, params), "untrained (no exp/model.pt)"
    changes = {"train.optim.epochs": FALLBACK_EPOCHS, "run.num_workers": 0, "train.optim.warmup_steps": 5}
    changes |= {"train.optim.average_last": 1}
    shutil.rmtree(work / "decode-exp", ignore_errors=True)
    settings = train_settings(params, quick=False, data=data, overrides=changes)
    trainer = train_until(data, work / "decode-exp", settings)
    return trainer.paths.model_path, f"trained here: {FALLBACK_EPOCHS} epochs on yesno (no exp/model.pt)"


def encoder_seconds(bundle, cuts, max_batch_duration_s: float) -> float:
    """Seconds of features + encoder over the batches ``decode_split`` makes."""
    from asrflow.evaluation.evaluate import decoding_batches
    from asrflow.serving.inference import cut_features, log_probs

    start = time.perf_counter()
    for batch in decoding_batches(cuts, max_batch_duration_s):
        features, lengths = cut_features(bundle, batch)
        log_probs(bundle, features, lengths)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(__doc__.splitlines()[0], argv)
    import torch

    from asrflow.data.manifests import cut_text, load_cuts
    from asrflow.evaluation.evaluate import EvaluateConfig, decode_split
    from asrflow.evaluation.metrics import score_corpus
    from asrflow.params import build_config
    from asrflow.serving.bundle import load_bundle

    mode = "quick" if args.quick else "full"
    config = build_config(EvaluateConfig, repo_params().get("evaluate"), "evaluate")
    with workdir(args.workdir) as work:
        data = yesno_data(work)
        model_path, source = model_bundle(data, work, args.quick)
        bundle = load_bundle(model_path)
        cuts = load_cuts(data / "fbank", "test").to_eager()
        audio = sum(cut.duration for cut in cuts)
        configs = {"greedy": replace(config, decoder="greedy", lm_path=None), "beam": replace(config, decoder="beam")}
        decode_split(bundle, cuts, configs["greedy"])  # warm-up
        rtfs: dict[str, list[float]] = {"greedy": [], "beam": [], "encoder": []}
        hyps: dict[str, dict[str, str]] = {}
        for _ in range(REPEATS[mode]):  # interleaved, so all see the same load
            for kind, kind_config in configs.items():
                hyps[kind], rtf = decode_split(bundle, cuts, kind_config)
                rtfs[kind].append(rtf["total"])
            rtfs["encoder"].append(encoder_seconds(bundle, cuts, config.max_batch_duration_s) / audio)
        score = score_corpus({cut.id: cut_text(cut) for cut in cuts}, hyps[config.decoder])
        greedy, beam, encoder = (statistics.median(rtfs[kind]) for kind in ("greedy", "beam", "encoder"))
        record = {"benchmark": "decode_rtf", "mode": mode, "model": source, "utterances": len(cuts), "audio_s": audio}
        record |= {"parameters": sum(p.numel() for p in bundle.model.parameters())}
        record |= {"decoder_in_params": config.decoder, "beam_size": config.beam_size, "beam_lm": config.lm_path}
        record |= {"torch_threads": torch.get_num_threads(), "rtf_greedy": greedy, "rtf_beam": beam}
        record |= {"rtf_encoder": encoder, "greedy_vs_encoder": ratio(greedy, encoder)}
        record |= {"beam_vs_encoder": ratio(beam, encoder), "beam_vs_greedy": ratio(beam, greedy)}
        return [emit({**record, "repeats": REPEATS[mode], "wer": score.wer})]


if __name__ == "__main__":
    main()
