"""SpeechBrain's whole training loop, as its LibriSpeech Conformer-CTC recipe builds one, for a fixed wall time.

Its ``Brain`` (fit loop, AdamW, gradient clipping, bf16 autocast), its data pipeline (``DynamicItemDataset`` from
CSV, audio read and resampled in data-loader workers, ``DynamicBatchSampler``), its features (``Fbank``, global
``InputNormalization``, ``SpectrogramDrop`` for SpecAugment), its Conformer with relative-position attention
(``RelPosMHAXL``), its CTC loss and greedy decoder. What asrflow sets (model shape, peak learning rate and warm-up,
weight decay, batch seconds, mask counts and widths, precision, threads) is taken from asrflow's params, so the
comparison changes the tool and nothing else. Training stops at the first batch past the deadline (or after
``max_steps``); the model as it is then decodes the test CSV (unless ``decode`` is false), and the report holds each
utterance's hypothesis for the caller to score, and each step's end time and audio seconds. It trains on
``device`` (``cpu`` or ``cuda``) with ``num_workers`` data-loader processes.

Run by :mod:`bench.peer_accuracy` and by :mod:`bench.peer_speed` (``--loop whole``) in a process of its own
(``python -m bench.peer.speechbrain_recipe REPORT LAUNCHED OPTIONS``), with SpeechBrain on its path
(:func:`bench.peer.install.peer_env`).
"""

from __future__ import annotations

import contextlib
import time

from bench.peer.side import peak_gpu_mb, run_as_child
from bench.peer.speechbrain_side import speechbrain_model

#: Data-loader processes reading audio, unless the options say: one keeps up with a 4 M model on 2 cores and leaves
#: the other to compute.
NUM_WORKERS = 1
#: Utterances per decoding batch (the test CSV is sorted by duration, so padding stays small).
DECODE_BATCH = 16


class TimeUp(Exception):
    """Raised at the first training batch after the deadline or the last step."""


def datasets(options: dict, tokenizer):
    """SpeechBrain's train and test datasets from the CSVs (``ID, duration, wav, start, stop, sample_rate, wrd``),
    with the audio pipeline (read, resample to the features' rate) and the text pipeline (SentencePiece ids)."""
    import speechbrain as sb
    import torch
    import torchaudio

    train = sb.dataio.dataset.DynamicItemDataset.from_csv(options["train_csv"])
    test = sb.dataio.dataset.DynamicItemDataset.from_csv(options["test_csv"]).filtered_sorted(sort_key="duration")
    target_rate = options["sampling_rate"]

    @sb.utils.data_pipeline.takes("wav", "start", "stop", "sample_rate")
    @sb.utils.data_pipeline.provides("sig")
    def audio(wav, start, stop, sample_rate):
        signal = sb.dataio.dataio.read_audio({"file": wav, "start": int(start), "stop": int(stop)})
        return torchaudio.functional.resample(signal, int(sample_rate), target_rate)

    @sb.utils.data_pipeline.takes("wrd")
    @sb.utils.data_pipeline.provides("tokens")
    def text(words):
        return torch.LongTensor(tokenizer.encode(words, out_type=int))

    sb.dataio.dataset.add_dynamic_item([train, test], audio)
    sb.dataio.dataset.add_dynamic_item([train, test], text)
    sb.dataio.dataset.set_output_keys([train, test], ["id", "sig", "tokens"])
    return train, test


def speechbrain_spec_augment(data: dict):
    """Frequency and time masks as asrflow's ``train.data`` sets them (counts, widths), SpeechBrain's modules."""
    import torch
    from speechbrain.augment.freq_domain import SpectrogramDrop

    if not data["spec_augment"]:
        return None

    def masks(count: int, width: int, dim: int):
        """``count`` masks of 0 to ``width`` bins (``dim=2``) or frames (``dim=1``), zeros as asrflow's."""
        return SpectrogramDrop(0, width, drop_count_low=count, drop_count_high=count, replace="zeros", dim=dim)

    freq = masks(data["num_freq_masks"], data["freq_mask_width"], dim=2)
    return torch.nn.Sequential(freq, masks(data["num_time_masks"], data["time_mask_frames"], dim=1))


def make_brain(options: dict, model, deadline: float):
    """A ``Brain`` that trains ``model`` on fbank of the waveforms, records each step's end (unix s) and audio
    seconds in ``step_times``, and raises :class:`TimeUp` after ``deadline`` or ``options["max_steps"]`` steps."""
    import speechbrain as sb
    import torch
    from speechbrain.lobes.features import Fbank
    from speechbrain.nnet.losses import ctc_loss
    from speechbrain.nnet.schedulers import NoamScheduler
    from speechbrain.processing.features import InputNormalization
    from speechbrain.utils.epoch_loop import EpochCounter

    optim, max_steps, rate = options["optim"], options.get("max_steps"), options["sampling_rate"]

    class CtcBrain(sb.Brain):
        def compute_forward(self, batch, stage):
            """Waveforms -> ((N, T', V) CTC log-probabilities, (N,) relative lengths)."""
            batch = batch.to(self.device)
            wavs, relative = batch.sig
            features = self.modules.normalize(self.hparams.fbank(wavs), relative, epoch=self.hparams.epochs.current)
            if stage == sb.Stage.TRAIN and self.hparams.augment is not None:
                features = self.hparams.augment(features)
            return self.modules.model.log_probs(features, relative), relative

        def compute_objectives(self, predictions, batch, stage):
            log_probs, relative = predictions
            tokens, token_lens = batch.tokens
            return ctc_loss(log_probs, tokens, relative, token_lens, blank_index=0, reduction="batchmean")

        def on_fit_batch_start(self, batch, should_step):
            if time.time() >= deadline or (max_steps is not None and len(self.step_times) >= max_steps):
                raise TimeUp

        def on_fit_batch_end(self, batch, outputs, loss, should_step):
            self.last_loss = float(loss)  # waits for the step on a GPU, so the time below is its end
            if should_step:
                self.hparams.schedule(self.optimizer)
            wavs, relative = batch.sig  # (N, samples) padded, (N,) lengths as fractions: on the host
            self.step_times.append({"t": time.time(), "audio_s": float(relative.sum()) * wavs.shape[1] / rate})

    hparams = {
        "fbank": Fbank(
            sample_rate=options["sampling_rate"],
            n_mels=options["num_mel_bins"],
            hop_length=options["frame_shift_s"] * 1000,  # SpeechBrain's unit: ms
            win_length=options["frame_length_s"] * 1000,
        ),
        "augment": speechbrain_spec_augment(options["data"]),
        "schedule": NoamScheduler(lr_initial=optim["lr"], n_warmup_steps=max(optim["warmup_steps"], 1)),
        "epochs": EpochCounter(limit=10**6),
    }
    modules = {"model": model, "normalize": InputNormalization(norm_type="global", update_until_epoch=4)}
    adamw = lambda params: torch.optim.AdamW(params, lr=optim["lr"], weight_decay=optim["weight_decay"])  # noqa: E731
    run_opts = {"device": options.get("device", "cpu"), "precision": optim["precision"]}
    run_opts["max_grad_norm"] = optim["max_grad_norm"]
    brain = CtcBrain(modules=modules, opt_class=adamw, hparams=hparams, run_opts=run_opts | {"noprogressbar": True})
    brain.step_times = []
    return brain


def decode(brain, test, tokenizer) -> dict[str, str]:
    """Greedy CTC hypotheses of the test set, by utterance id (fp32, as SpeechBrain evaluates by default)."""
    import speechbrain as sb
    import torch
    from speechbrain.decoders import ctc_greedy_decode

    brain.modules.eval()
    hyps: dict[str, str] = {}
    loader = sb.dataio.dataloader.make_dataloader(test, batch_size=DECODE_BATCH)
    with torch.no_grad():
        for batch in loader:
            log_probs, relative = brain.compute_forward(batch, sb.Stage.TEST)
            for utt_id, ids in zip(batch.id, ctc_greedy_decode(log_probs, relative, blank_id=0), strict=True):
                hyps[utt_id] = tokenizer.decode([i for i in ids if i != 0])
    return hyps


def train(options: dict, launched: float) -> dict:
    import sentencepiece
    import speechbrain as sb
    import torch

    torch.set_num_threads(options["optim"]["num_threads"])
    torch.manual_seed(options["seed"])
    tokenizer = sentencepiece.SentencePieceProcessor(model_file=options["tokenizer"])
    train_set, test_set = datasets(options, tokenizer)
    model = speechbrain_model(
        options["model"], options["num_mel_bins"], tokenizer.get_piece_size(), attention_type="RelPosMHAXL"
    )
    brain = make_brain(options, model, launched + options["minutes"] * 60)
    data = options["data"]
    sampler = sb.dataio.sampler.DynamicBatchSampler(
        train_set,
        data["max_duration_s"],
        num_buckets=data["num_buckets"],
        length_func=lambda item: float(item["duration"]),
        shuffle=True,
        batch_ordering="random",
        seed=options["seed"],
    )
    loader = {"batch_sampler": sampler, "num_workers": options.get("num_workers", NUM_WORKERS)}
    with contextlib.suppress(TimeUp):  # the deadline: stop where the loop is, as a SIGTERM stops asrflow
        brain.fit(brain.hparams.epochs, train_set, train_loader_kwargs=loader)
    trained = time.time()
    found = {"steps": brain.optimizer_step, "step_times": brain.step_times, "peak_gpu_mb": peak_gpu_mb()}
    # Brain's avg_train_loss restarts at 0 with each epoch; the last batch's loss is what the run ended at.
    found |= {"last_train_loss_batchmean": getattr(brain, "last_loss", None), "launched": launched}
    found |= {"params": sum(p.numel() for p in model.parameters()), "train_s": trained - launched}
    hyps = decode(brain, test_set, tokenizer) if options.get("decode", True) else {}
    return found | {"decode_s": time.time() - trained, "hyps": hyps}


if __name__ == "__main__":
    run_as_child(train)
