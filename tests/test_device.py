"""Device settings of decoding and serving (``asrflow.serving.device``)."""

from __future__ import annotations

import pytest
import torch

from asrflow.errors import AsrflowError
from asrflow.serving.device import is_device_name, resolve_device


def test_auto_takes_a_gpu_when_there_is_one():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto", "evaluate.device").type == expected
    assert resolve_device("cpu", "evaluate.device") == torch.device("cpu")


@pytest.mark.parametrize("value", ["gpu", "cuda:x", "CPU", "", None, 0])
def test_a_value_that_names_no_device_is_refused_with_the_choices(value):
    assert not is_device_name(value)
    with pytest.raises(AsrflowError) as error:
        resolve_device(value, "--device")
    assert str(error.value) == f"--device = {value!r} is not a device: use one of auto, cpu, cuda, cuda:N"


def test_a_gpu_the_machine_lacks_is_refused_with_what_was_found():
    missing = "cuda:0" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(AsrflowError) as error:
        resolve_device(missing, "evaluate.device")
    message = str(error.value)
    assert message.startswith(f"evaluate.device = {missing}, but ")
    assert (
        ("sees no CUDA GPU" in message or "CPU build" in message) if not torch.cuda.is_available() else "has" in message
    )
