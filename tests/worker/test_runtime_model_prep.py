"""DDP's buffer sync on every supported torch: the keyword its signature has."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from worker.runtime.env import DistEnv, init_distributed, shutdown_distributed
from worker.runtime.model_prep import buffer_sync_kwargs, prepare_model, wrap_ddp


def _ddp_2_13(
    module: nn.Module,
    device_ids: list[int] | None = None,
    broadcast_buffers: bool | None = None,
    forward_sync_buffers: bool | None = None,
) -> None:
    """The parameters that matter here of torch 2.13's DDP."""


def _ddp_2_11(
    module: nn.Module, device_ids: list[int] | None = None, broadcast_buffers: bool = True
) -> None:
    """... and of torch 2.11's, which has no forward_sync_buffers."""


@pytest.mark.parametrize(
    ("ddp", "kwargs"),
    [(_ddp_2_13, {"forward_sync_buffers": True}), (_ddp_2_11, {"broadcast_buffers": True})],
    ids=["torch-2.13", "torch-2.11"],
)
def test_buffer_sync_takes_the_keyword_the_signature_has(
    ddp: Callable[..., None], kwargs: dict[str, bool]
) -> None:
    parameters = inspect.signature(ddp).parameters
    assert buffer_sync_kwargs(parameters) == kwargs


def test_the_installed_ddp_is_wrapped_without_a_deprecated_keyword() -> None:
    init_distributed(DistEnv(device="cpu"))
    try:
        model = prepare_model(
            nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)), torch.device("cpu")
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*broadcast_buffers.*")
            ddp = wrap_ddp(model, torch.device("cpu"))
        synced = getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", None))
        assert synced is True
        assert ddp(torch.randn(4, 3)).shape == (4, 2)
    finally:
        shutdown_distributed()
