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

from asrflow.testing.corpora import yesno_data
from asrflow.testing.repo import REPO, repo_params
from bench.common import emit, parse_args, ratio, rounded, workdir

REPEATS = {"full": 3, "quick": 1}
#: Epochs of the fallback model (when exp/model.pt is missing), full mode.
FALLBACK_EPOCHS = 5


def model_bundle(data: Path, work: Path, quick: bool) -> tuple[Path, str]:
    """A model file to decode with, and where it came from."""
    from asrflow.errors import AsrflowError
    from asrflow.serving.bundle import load_bundle

    repo_model = REPO / "exp" / "model.pt"
    try:
        load_bundle(repo_model)
        copy = work / "decode-model.pt"
        shutil.copyfile(repo_model, copy)  # the training stage may replace it meanwhile
        return copy, "exp/model.pt"
    except AsrflowError:
        pass
    return (
        (untrained(data, work), "untrained (no exp/model.pt)")
        if quick
        else (trained(data, work), f"trained here: {FALLBACK_EPOCHS} epochs on yesno (no exp/model.pt)")
    )


def untrained(data: Path, work: Path) -> Path:
    """A bundle of params.yaml's model with its initial weights."""
    import torch

    from asrflow.data.features import CMVN_FILE, FeatureConfig, cmvn_stats, load_cmvn
    from asrflow.model.conformer_ctc import build_model
    from asrflow.params import build_config
    from asrflow.serving.bundle import save_bundle
    from asrflow.tokenizer import MODEL_FILE, Tokenizer
    from asrflow.training.config import load_train_config

    params = repo_params()
    train = load_train_config(params)
    features = build_config(FeatureConfig, params.get("features"), "features")
    tokenizer = Tokenizer(data / "lang" / MODEL_FILE)
    config = train.model(features.num_mel_bins, tokenizer.vocab_size)
    torch.manual_seed(0)
    cmvn = cmvn_stats(load_cmvn(data / "fbank" / CMVN_FILE))
    path = work / "decode-model-untrained.pt"
    model = build_model(config).state_dict()
    save_bundle(
        path, model_state=model, model_config=config, tokenizer=tokenizer, features=features, cmvn=cmvn, run_id=None
    )
    return path


def trained(data: Path, work: Path) -> Path:
    """Train params.yaml's model on yesno for a few epochs with the Trainer."""
    from asrflow.data.features import FeatureConfig
    from asrflow.params import build_config
    from asrflow.training.config import TrainPaths, load_train_config
    from asrflow.training.trainer import Trainer

    params = repo_params()
    changes = {"epochs": FALLBACK_EPOCHS, "num_workers": 0, "warmup_steps": 5, "average_last": 1}
    train = replace(load_train_config(params), **changes)
    features = build_config(FeatureConfig, params.get("features"), "features")
    exp = work / "decode-exp"
    shutil.rmtree(exp, ignore_errors=True)
    paths = TrainPaths.under(exp, fbank_dir=data / "fbank", lang_dir=data / "lang")
    uri = f"sqlite:///{work / 'bench-mlflow.db'}"
    Trainer(train, features, seed=int(params.get("seed", 0)), all_params=params, paths=paths, tracking_uri=uri).run()
    return paths.model_path


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
        rtf_greedy, rtf_beam, rtf_encoder = (statistics.median(rtfs[kind]) for kind in ("greedy", "beam", "encoder"))
        record = {"benchmark": "decode_rtf", "mode": mode, "model": source, "utterances": len(cuts)}
        record |= {"parameters": sum(p.numel() for p in bundle.model.parameters()), "audio_s": rounded(audio)}
        record |= {"decoder_in_params": config.decoder, "beam_size": config.beam_size, "beam_lm": config.lm_path}
        record |= {"torch_threads": torch.get_num_threads(), "rtf_greedy": rounded(rtf_greedy)}
        record |= {"rtf_beam": rounded(rtf_beam), "rtf_encoder": rounded(rtf_encoder)}
        record |= {"greedy_vs_encoder": rounded(ratio(rtf_greedy, rtf_encoder))}
        record |= {"beam_vs_encoder": rounded(ratio(rtf_beam, rtf_encoder))}
        record |= {"beam_vs_greedy": rounded(ratio(rtf_beam, rtf_greedy))}
        return [emit({**record, "repeats": REPEATS[mode], "wer": rounded(score.wer)})]


if __name__ == "__main__":
    main()
