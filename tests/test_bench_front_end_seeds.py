"""bench.front_end and bench.yesno_seeds: the parts that decide what they report (no timing)."""

from __future__ import annotations

import pytest
import yaml

from asrflow.model.conformer_ctc import ModelConfig, build_model
from asrflow.testing.repo import REPO
from bench.front_end import _front_end_flops
from bench.yesno_seeds import seeded_params


def test_front_end_flops_count_the_subsampling_convolutions():
    def flops(channels):
        config = ModelConfig(
            input_dim=80,
            vocab_size=9,
            d_model=64,
            num_heads=2,
            ffn_dim=64,
            num_layers=1,
            subsampling_channels=channels,
            subsampling_norm=True,
        )
        return _front_end_flops(build_model(config).subsampling, 200)

    wide, narrow = flops((64, 64)), flops((16, 32))
    # the second convolution dominates: 9 * c1 * c2 multiply-adds per output point
    assert narrow < wide / 4


def test_seeded_params_set_the_seed_and_overrides_and_refuse_unknown_keys():
    params = seeded_params(7, ["train.optim.lr=0.001", "train.model.subsampling_channels=[8, 32]"], quick=False)
    shipped = yaml.safe_load((REPO / "params.yaml").read_text())
    assert params["seed"] == 7
    assert params["train"]["optim"]["lr"] == 0.001 and params["train"]["model"]["subsampling_channels"] == [8, 32]
    assert params["train"]["optim"]["epochs"] == shipped["train"]["optim"]["epochs"]
    assert seeded_params(7, [], quick=True)["train"]["optim"]["epochs"] == 2
    with pytest.raises(SystemExit, match="train.no_such_key"):
        seeded_params(7, ["train.no_such_key=1"], quick=False)
