"""What ``configure_process`` sets for a training process, by device."""

from __future__ import annotations

import subprocess
import sys

import torch

from asrflow.training.assemble import use_shape_free_attention
from tests.support.repo import REPO

SCRIPT = """
import torch
from tests.support.repo import repo_params
from asrflow.training.assemble import configure_process
from asrflow.training.config import load_train_config

configure_process(load_train_config(repo_params()).optim)
print(torch.get_num_threads(), torch.backends.cuda.cudnn_sdp_enabled())
"""


def test_shape_free_attention_leaves_the_other_kernels_to_choose_from():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        use_shape_free_attention()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_a_training_process_takes_its_threads_and_on_a_gpu_its_attention_kernels():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    threads, cudnn_attention = done.stdout.split()
    assert int(threads) == 1  # params.yaml's train.optim.num_threads
    assert cudnn_attention == str(not torch.cuda.is_available())
