"""asrflow: reproducible Conformer-CTC speech-recognition pipelines on Lhotse, PyTorch, Snakemake and DVC."""

__version__ = "0.1.0"
