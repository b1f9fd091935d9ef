"""WER against SpeechBrain at equal wall time: each tool's whole training loop for the same minutes, then test WER.

``python -m bench.peer_accuracy --data RUN --minutes 30 [--precisions fp32 bf16] [--train JSON] [--quick]
[--workdir W]``

``RUN`` is a folder holding ``params.yaml``, ``fbank/`` and ``lang/`` (as ``python -m bench.stage_scale`` leaves
``W/run-spoken-<hours>``), with ``--train``'s overrides (dotted keys) on top; ``--quick`` uses the shipped yesno
corpus for a few seconds each. Per precision, one after the other so each has the machine alone:

- asrflow: the train stage as users run it on ``RUN``'s params, stopped by SIGTERM ``--minutes`` after launch, then
  the evaluate stage on its newest checkpoint (:mod:`bench.accuracy_at_time`);
- SpeechBrain: its ``Brain`` on its own data pipeline from the same audio, its Conformer with relative positions at
  asrflow's shape, the same tokenizer, learning rate, warm-up, batch seconds and masks
  (:mod:`bench.peer.speechbrain_recipe`), stopped at the same deadline, then greedy decoding of the same test
  utterances, scored with asrflow's scorer against the same transcripts.

Records ``peer_accuracy`` per precision: each side's steps, test WER and CER, parameters and the training process
tree's peak PSS; ``wer_ratio`` and ``cer_ratio`` are asrflow / SpeechBrain (goal: both <= 1). ``--sides speechbrain``
trains the peer alone (at other settings than a run already recorded for asrflow, say): its record has no ratios.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import yaml

from asrflow.data.manifests import cut_text, list_test_sets, load_cuts
from asrflow.evaluation.metrics import score_corpus
from asrflow.params import with_overrides
from bench.accuracy_at_time import score_run, train_for
from bench.common import emit, load_average, machine, parse_args, ratio, workdir
from bench.peer.install import PEER_VERSION, install_peer, peer_env
from bench.peer.side import audio_rate, run_child
from tests.support.corpora import params_for, yesno_data
from tests.support.repo import repo_params

CSV_COLUMNS = ("ID", "duration", "wav", "start", "stop", "sample_rate", "wrd")
SIDES = ("asrflow", "speechbrain")


def write_csv(cuts, path: Path) -> float:
    """SpeechBrain's CSV of ``cuts`` (one row per cut: its recording's file, the cut's span in samples, its
    transcript) at ``path``; returns the mean duration in seconds.

    Raises:
        ValueError: a cut whose audio is not one plain file (SpeechBrain's ``read_audio`` reads files only).
    """
    rows, total = [], 0.0
    for cut in cuts:
        sources = cut.recording.sources
        if len(sources) != 1 or sources[0].type != "file":
            raise ValueError(f"cut {cut.id}: its audio is not one file ({sources}); SpeechBrain reads files only")
        rate = cut.recording.sampling_rate
        start, stop = round(cut.start * rate), round((cut.start + cut.duration) * rate)
        rows.append([cut.id, cut.duration, sources[0].source, start, stop, rate, cut_text(cut)])
        total += cut.duration
    with open(path, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(CSV_COLUMNS)
        writer.writerows(rows)
    return total / max(len(rows), 1)


def speechbrain_inputs(data: Path, out: Path) -> tuple[dict, dict[str, str]]:
    """CSVs of ``data``'s train split and of all its test sets (pooled, as evaluate's headline WER), written
    into ``out``: the SpeechBrain side's file options, and the test transcripts by utterance id."""
    out.mkdir(parents=True, exist_ok=True)
    fbank = data / "fbank"
    mean_train_s = write_csv(load_cuts(fbank, "train"), out / "train.csv")
    tests = [cut for name in list_test_sets(fbank) for cut in load_cuts(fbank, name)]
    write_csv(tests, out / "test.csv")
    files = {"train_csv": str(out / "train.csv"), "test_csv": str(out / "test.csv")}
    files["tokenizer"] = str(data / "lang" / "tokenizer.model")
    return files | {"mean_train_s": mean_train_s}, {cut.id: cut_text(cut) for cut in tests}


def speechbrain_options(params: dict, files: dict, minutes: float) -> dict:
    """The SpeechBrain side's options: asrflow's ``params`` where they have a counterpart there."""
    train = params["train"]
    data = train["data"]
    masks = {key: data[key] for key in ("spec_augment", "num_freq_masks", "freq_mask_width", "num_time_masks")}
    fbank = params["features"]
    # asrflow's time mask is a share of each utterance; SpeechBrain's is frames, so that share of the mean one.
    masks["time_mask_frames"] = max(1, round(data["time_mask_ratio"] * files["mean_train_s"] / fbank["frame_shift_s"]))
    batches = {"max_duration_s": data["max_duration_s"], "num_buckets": data["num_buckets"]}
    optim = {key: train["optim"][key] for key in ("lr", "weight_decay", "warmup_steps", "max_grad_norm")}
    optim |= {"precision": train["optim"]["precision"], "num_threads": train["optim"]["num_threads"]}
    features = {key: fbank[key] for key in ("sampling_rate", "num_mel_bins", "frame_shift_s", "frame_length_s")}
    options = {"model": train["model"], "data": masks | batches, "optim": optim, "seed": params.get("seed", 0)}
    return options | features | {"minutes": minutes} | files


def run_speechbrain(options: dict, refs: dict[str, str], log: Path) -> dict:
    """The SpeechBrain side in a process of its own: steps, WER, CER, parameters, peak tree PSS, audio seconds
    trained per second after its first step."""
    env = peer_env() | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(options["optim"]["num_threads"])}
    found = run_child("bench.peer.speechbrain_recipe", options, log, env)
    score = score_corpus(refs, found.pop("hyps"))
    return found | {"wer": score.wer, "cer": score.cer, "audio_s_per_s": audio_rate(found.pop("step_times"))}


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser) -> None:
        parser.add_argument("--data", type=Path, help="run folder with params.yaml, fbank/, lang/ (not with --quick)")
        parser.add_argument("--minutes", type=float, default=30.0, help="training time per side (default: 30)")
        parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
        parser.add_argument("--train", type=json.loads, default={}, help="params overrides as JSON, dotted keys")
        parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES, help="only these (default: both)")

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    if not args.quick and args.data is None:
        raise SystemExit("bench.peer_accuracy: --data RUN is needed (a folder bench.stage_scale left), or --quick")
    minutes = 0.3 if args.quick else args.minutes
    records = [emit({"benchmark": "machine", **machine(), "load_before": load_average()})]
    problem = install_peer()
    with workdir(args.workdir) as work:
        data = yesno_data(work) if args.quick else args.data.resolve()
        base = params_for(data, repo_params()) if args.quick else yaml.safe_load((data / "params.yaml").read_text())
        files, refs = speechbrain_inputs(data, work / "speechbrain-csv")
        for precision in args.precisions:
            fixed = {"train.optim.epochs": 1000, "train.optim.precision": precision}
            params = with_overrides(base, args.train | fixed, "--train")
            record = {"benchmark": "peer_accuracy", "precision": precision, "minutes": minutes, "data": str(data)}
            record |= {"overrides": args.train}
            record |= {"peer": f"speechbrain {PEER_VERSION}", "load_before": load_average()}
            if "asrflow" in args.sides:
                run_dir = work / f"peer-accuracy-asrflow-{precision}"
                record["asrflow"] = train_for(run_dir, data, params, minutes) | score_run(run_dir, data)
            if "speechbrain" in args.sides:
                if problem is not None:
                    records.append(emit(record | {"status": "peer unavailable", "reason": problem}))
                    continue
                options = speechbrain_options(params, files, minutes)
                log = work / f"peer-accuracy-speechbrain-{precision}.log"
                record["speechbrain"] = run_speechbrain(options, refs, log)
            if len(args.sides) < len(SIDES):
                records.append(emit(record | {"load_after": load_average()}))
                continue
            ours, theirs = record["asrflow"], record["speechbrain"]
            record |= {"wer_ratio": ratio(ours["wer"], theirs["wer"]), "cer_ratio": ratio(ours["cer"], theirs["cer"])}
            record["no_worse"] = ours["wer"] <= theirs["wer"] and ours["cer"] <= theirs["cer"]
            records.append(emit(record | {"load_after": load_average()}))
    return records


if __name__ == "__main__":
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    main()
