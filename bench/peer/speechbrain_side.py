"""SpeechBrain's side: its Conformer-CTC as its LibriSpeech CTC recipes build it, trained on the dumped batches
with forward, ``log_softmax``, ``ctc_loss``, backward, clipping and AdamW on asrflow's schedule, on a CUDA GPU when
there is one (as asrflow's Trainer picks)."""

from __future__ import annotations

import time
from pathlib import Path

from bench.common import on_device
from bench.peer.side import report, run_as_child


def speechbrain_model(config: dict, input_dim: int, vocab_size: int, *, attention_type: str = "regularMHA"):
    """Two stride-2 convolution blocks (64, 32 channels), a Conformer encoder of asrflow's shape (``config``: its
    ``train.model`` section as a dict) with SpeechBrain's ``attention_type`` (``regularMHA``: no positions;
    ``RelPosMHAXL``: relative positions, as its LibriSpeech Conformer recipes), a CTC head."""
    import torch
    from speechbrain.lobes.models.convolution import ConvolutionFrontEnd
    from speechbrain.lobes.models.transformer.TransformerASR import TransformerASR

    blocks = {"num_blocks": 2, "num_layers_per_block": 1, "out_channels": (64, 32), "kernel_sizes": (3, 3)}
    cnn = ConvolutionFrontEnd(input_shape=(8, 10, input_dim), strides=(2, 2), residuals=(False, False), **blocks)
    freq = cnn(torch.zeros(1, 16, input_dim)).shape[-2:]  # (F', C)
    shape = {"d_model": config["d_model"], "nhead": config["num_heads"], "num_encoder_layers": config["num_layers"]}
    shape |= {"d_ffn": config["ffn_dim"], "dropout": config["dropout"], "kernel_size": config["conv_kernel_size"]}
    kind = {"encoder_module": "conformer", "attention_type": attention_type, "normalize_before": True, "causal": False}
    kind |= {"num_decoder_layers": 0, "activation": torch.nn.GELU}
    transformer = TransformerASR(input_size=freq[0] * freq[1], tgt_vocab=vocab_size, **shape, **kind)

    class SpeechBrainCtc(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cnn, self.transformer = cnn, transformer
            self.ctc_lin = torch.nn.Linear(config["d_model"], vocab_size)

        def forward(self, features, feature_lens):
            """(N, T, F) fbank, (N,) frames -> (N, T', V) log-probabilities, (N,) output frames."""
            relative = feature_lens.float() / features.shape[1]
            log_probs = self.log_probs(features, relative)
            out_lens = torch.clamp((relative * log_probs.shape[1]).round().long(), 1, log_probs.shape[1])
            return log_probs, out_lens

        def log_probs(self, features, relative):
            """(N, T, F) fbank, (N,) lengths as fractions of T (SpeechBrain's convention) -> (N, T', V)."""
            x = self.cnn(features)  # (N, T', F', C), flattened by the transformer
            encoded = self.transformer.encode(x, relative)  # (N, T', D)
            return self.ctc_lin(encoded).log_softmax(-1)

    return SpeechBrainCtc()


def train(options: dict, launched: float) -> dict:
    import torch
    import torch.nn.functional as F

    train = options["params"]["train"]  # asrflow's params: the same model shape and optimizer settings
    config = train["optim"]
    torch.set_num_threads(config["num_threads"])
    torch.manual_seed(options["seed"])
    folder, device = Path(options["batches"]), torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def load(name: str) -> dict:
        """A dumped batch, its tensors on ``device``."""
        return on_device(torch.load(folder / name, weights_only=True), device)

    first = load("step-0.pt")
    model = speechbrain_model(train["model"], first["features"].shape[-1], options["vocab_size"]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=config["weight_decay"])
    warmup = config["warmup_steps"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) / warmup, (warmup / (step + 1)) ** 0.5) if warmup else 1.0
    )

    def loss_sum(batch):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config["precision"] == "bf16"):
            log_probs, out_lens = model(batch["features"], batch["feature_lens"])
        args = (log_probs.float().transpose(0, 1), batch["targets"], out_lens, batch["target_lens"])
        return F.ctc_loss(*args, reduction="sum", zero_infinity=True)

    steps: list[dict] = []
    total = len(list(folder.glob("step-*.pt")))
    limit = total if options["max_steps"] is None else min(total, options["max_steps"])
    model.train()
    for index in range(limit):
        batch = first if index == 0 else load(f"step-{index}.pt")
        optimizer.zero_grad(set_to_none=True)
        (loss_sum(batch) / max(int(batch["step_tokens"]), 1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config["max_grad_norm"])
        optimizer.step()
        scheduler.step()
        audio_s = float(batch["durations"].sum())  # waits for the step on a GPU, so the time below is its end
        steps.append({"t": time.time(), "audio_s": audio_s})
    loss = None
    if options["dev"]:
        model.eval()
        total_loss, tokens = 0.0, 0.0
        with torch.no_grad():
            for path in sorted(folder.glob("dev-*.pt")):
                batch = load(path.name)
                total_loss += float(loss_sum(batch))
                tokens += float(batch["target_lens"].sum())
        loss = total_loss / max(tokens, 1.0)
        model.train()
    settings = {"num_threads": config["num_threads"], "num_workers": 0, "precision": config["precision"]}
    forward_backward = lambda: loss_sum(first).backward()  # noqa: E731
    return report(model, forward_backward, first, steps=steps, launched=launched, dev_loss=loss, settings=settings)


if __name__ == "__main__":
    run_as_child(train)
