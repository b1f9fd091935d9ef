"""asrflow.launch.multinode: a cluster job's rendezvous written into params.yaml, in place."""

from __future__ import annotations

import pytest
import yaml
from conftest import REPO

from asrflow.errors import AsrflowError
from asrflow.launch.multinode import main, set_rendezvous


def test_the_shipped_params_get_both_keys_and_keep_every_other_line(tmp_path):
    params = tmp_path / "params.yaml"
    shipped = (REPO / "params.yaml").read_text()
    params.write_text(shipped)
    changes = set_rendezvous(params, 2, "node17:29511")
    assert changes == ["run.nnodes: 1 -> 2", "run.rdzv_endpoint: 'localhost:29500' -> 'node17:29511'"]
    text = params.read_text()
    changed = [(old, new) for old, new in zip(shipped.splitlines(), text.splitlines(), strict=True) if old != new]
    assert changed == [
        ("  nnodes: 1", "  nnodes: 2"),
        ("  rdzv_endpoint: localhost:29500", "  rdzv_endpoint: node17:29511"),
    ]
    loaded, before = yaml.safe_load(text), yaml.safe_load(shipped)
    assert loaded["run"] == {**before["run"], "nnodes": 2, "rdzv_endpoint": "node17:29511"}
    assert {key: value for key, value in loaded.items() if key != "run"} == {
        key: value for key, value in before.items() if key != "train"
    }


def test_values_already_set_leave_the_file_untouched(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("seed: 1\ntrain:\n  nnodes: 2   # two machines\n  rdzv_endpoint: a:1\n")
    before = params.stat().st_mtime_ns
    assert set_rendezvous(params, 2, "a:1") == []
    assert params.stat().st_mtime_ns == before


def test_comments_are_kept_and_missing_keys_are_added_to_the_train_section(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("train:  # training\n  lr: 0.001\n  nnodes: 1   # machines\n# next\nevaluate:\n  beam_size: 8\n")
    set_rendezvous(params, 3, "head:29500")
    assert params.read_text() == (
        "train:  # training\n  rdzv_endpoint: head:29500\n  lr: 0.001\n  nnodes: 3   # machines\n"
        "# next\nevaluate:\n  beam_size: 8\n"
    )


@pytest.mark.parametrize(
    ("content", "nnodes", "endpoint", "message"),
    [
        ("train:\n  nnodes: 1\n", 2, "head", r"--endpoint 'head': must be host:port"),
        ("train:\n  nnodes: 1\n", 2, "head:99999", r"--endpoint 'head:99999': must be host:port"),
        ("train:\n  nnodes: 1\n", 0, "head:1", r"--nnodes 0: must be at least 1"),
        ("evaluate:\n  beam_size: 8\n", 2, "head:1", r"no 'train:' section"),
        ("train: {nnodes: 1}\n", 2, "head:1", r"is not a block of 'key: value' lines"),
    ],
)
def test_bad_input_names_the_item(tmp_path, content, nnodes, endpoint, message):
    params = tmp_path / "params.yaml"
    params.write_text(content)
    with pytest.raises(AsrflowError, match=message):
        set_rendezvous(params, nnodes, endpoint)
    assert params.read_text() == content


def test_the_command_line_says_what_it_changed_and_exits_2_on_bad_input(tmp_path, capsys):
    params = tmp_path / "params.yaml"
    params.write_text("train:\n  nnodes: 1\n  rdzv_endpoint: localhost:29500\n")
    main(["--params", str(params), "--nnodes", "2", "--endpoint", "h:2"])
    assert "train.nnodes: 1 -> 2; train.rdzv_endpoint: 'localhost:29500' -> 'h:2'" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["--params", str(tmp_path / "missing.yaml"), "--nnodes", "2", "--endpoint", "h:2"])
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr().err.strip()
        == f"error: {tmp_path / 'missing.yaml'}: cannot read it (No such file or directory)"
    )
