"""Getting a model ready for DDP: seeding, device placement, BatchNorm and the wrap.

SyncBatchNorm: torch 2.13 supports it only on GPU (its forward raises
``ValueError`` for CPU tensors, and DDP refuses CPU modules holding it). So
``prepare_model`` converts BatchNorm to SyncBatchNorm on CUDA only. On CPU the
model keeps plain BatchNorm: each rank normalizes with its own batch statistics
and DDP's buffer sync copies rank 0's running statistics to every rank at each
forward, so all ranks evaluate identically. torch 2.13 names that keyword
``forward_sync_buffers`` and deprecates ``broadcast_buffers``; older releases (2.11)
have only ``broadcast_buffers``. ``wrap_ddp`` passes whichever DDP's signature has.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def seed_everything(seed: int) -> None:
    """Seed Python's and torch's (CPU and CUDA) generators; call before building a model
    so that every rank builds the same initial weights."""
    random.seed(seed)
    torch.manual_seed(seed)


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def prepare_model(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` on ``device``, its BatchNorm layers made SyncBatchNorm when that is CUDA.

    Parameters keep their identity (an optimizer built on them stays valid), and
    the state-dict keys do not change, so snapshots load either way.
    """
    model = model.to(device)
    if device.type == "cuda" and has_batchnorm(model):
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def buffer_sync_kwargs(ddp_parameters: Collection[str]) -> dict[str, Any]:
    """The keyword that turns on DDP's buffer sync at every forward, given the names of
    ``DistributedDataParallel.__init__``'s parameters: ``forward_sync_buffers`` where
    DDP has it (torch 2.13), else ``broadcast_buffers``, which it replaces. Both mean
    "rank 0's buffers are copied to every rank before each forward"."""
    if "forward_sync_buffers" in ddp_parameters:
        return {"forward_sync_buffers": True}
    return {"broadcast_buffers": True}


def wrap_ddp(model: nn.Module, device: torch.device) -> DistributedDataParallel:
    """``model`` (already on ``device``) wrapped in DDP, its buffers synced at every
    forward, on whichever torch release is installed."""
    device_ids = [device.index] if device.type == "cuda" else None
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    return DistributedDataParallel(model, device_ids=device_ids, **buffer_sync_kwargs(parameters))
