"""bench.yesno_seeds: the part that decides what it reports (no timing)."""

from __future__ import annotations

import pytest
import yaml

from bench.yesno_seeds import seeded_params
from tests.support.repo import REPO


def test_seeded_params_set_the_seed_and_overrides_and_refuse_unknown_keys():
    params = seeded_params(7, ["train.optim.lr=0.001", "train.model.subsampling_channels=[8, 32]"], quick=False)
    shipped = yaml.safe_load((REPO / "params.yaml").read_text())
    assert params["seed"] == 7
    assert params["train"]["optim"]["lr"] == 0.001 and params["train"]["model"]["subsampling_channels"] == [8, 32]
    assert params["train"]["optim"]["epochs"] == shipped["train"]["optim"]["epochs"]
    assert seeded_params(7, [], quick=True)["train"]["optim"]["epochs"] == 2
    with pytest.raises(SystemExit, match="train.no_such_key"):
        seeded_params(7, ["train.no_such_key=1"], quick=False)
    with pytest.raises(SystemExit, match="section.key=value"):
        seeded_params(7, ["train.optim.lr"], quick=False)
    for unsectioned in ("seed=3", "features=1"):  # the seed comes from --seeds; a whole section is not one key
        with pytest.raises(SystemExit, match="section.key=value"):
            seeded_params(7, [unsectioned], quick=False)
