"""Getting a model ready for DDP: seeding, device placement and BatchNorm.

SyncBatchNorm: torch 2.13 supports it only on GPU (its forward raises
``ValueError`` for CPU tensors, and DDP refuses CPU modules holding it). So
``prepare_model`` converts BatchNorm to SyncBatchNorm on CUDA only. On CPU the
model keeps plain BatchNorm: each rank normalizes with its own batch statistics
and DDP's buffer sync (``forward_sync_buffers``, which replaces the deprecated
``broadcast_buffers`` in torch 2.13) copies rank 0's running statistics to every
rank at each forward, so all ranks evaluate identically.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

import torch
from torch import nn

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
