"""A DistributedSampler that can resume part-way through an epoch, at any world size.

``DistributedSampler`` gives rank ``r`` of ``W`` the indices ``perm[r::W]`` of
the epoch's permutation ``perm``. With every rank taking ``b`` indices per batch,
after ``k`` batches the ranks together have consumed exactly ``perm[:k*b*W]``,
a prefix. So the progress of an epoch is one number, ``consumed``, independent of
the world size: a resumed epoch deals out ``perm[consumed:]`` over the ranks of
the current world, which is exact at the same world size and, at another one,
covers every sample not yet seen this epoch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler


def samples_per_rank(remaining: int, num_replicas: int, drop_last: bool) -> int:
    """How many indices each rank gets when ``remaining`` are dealt to ``num_replicas``."""
    if drop_last:
        return remaining // num_replicas
    return math.ceil(remaining / num_replicas)


def deal_indices(
    perm: list[int], consumed: int, num_replicas: int, rank: int, drop_last: bool
) -> list[int]:
    """Rank ``rank``'s share of ``perm[consumed:]``.

    The remaining list is padded by repeating it from its start (``drop_last``
    false) or truncated (``drop_last`` true) to a multiple of ``num_replicas``,
    then rank ``r`` takes ``remaining[r::num_replicas]``. Every rank gets the
    same count, so all ranks run the same number of batches.
    """
    remaining = perm[consumed:]
    per_rank = samples_per_rank(len(remaining), num_replicas, drop_last)
    total = per_rank * num_replicas
    if total > len(remaining):
        padding = total - len(remaining)
        remaining = remaining + (remaining * math.ceil(padding / len(remaining)))[:padding]
    else:
        remaining = remaining[:total]
    return remaining[rank:total:num_replicas]


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` plus ``set_epoch(epoch, consumed)``.

    The permutation of an epoch is ``DistributedSampler``'s (``randperm`` from a
    generator seeded with ``seed + epoch``, or ``range`` without shuffling), so
    with ``consumed=0`` this yields exactly what ``DistributedSampler`` yields.
    ``len()`` is the number of indices this rank yields for the current epoch
    and ``consumed``.
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            dataset,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        if not isinstance(dataset, Sized):
            raise ValueError("ResumableDistributedSampler needs a dataset with a length")
        self._dataset_len = len(dataset)
        self.consumed = 0
        self._resize()

    def _resize(self) -> None:
        remaining = self._dataset_len - self.consumed
        self.num_samples = samples_per_rank(remaining, self.num_replicas, self.drop_last)
        self.total_size = self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int, consumed: int = 0) -> None:
        """Select ``epoch``, of whose permutation ``consumed`` samples are already used.

        ``consumed`` counts samples over all ranks (of any earlier world size).
        Raises ``ValueError`` unless ``0 <= consumed <= len(dataset)``.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if not 0 <= consumed <= self._dataset_len:
            raise ValueError(f"consumed must be in [0, {self._dataset_len}], got {consumed}")
        self.epoch = epoch
        self.consumed = consumed
        self._resize()

    def permutation(self) -> list[int]:
        """The full order of the current epoch, before dealing to ranks."""
        if not self.shuffle:
            return list(range(self._dataset_len))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self._dataset_len, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        indices = deal_indices(
            self.permutation(), self.consumed, self.num_replicas, self.rank, self.drop_last
        )
        return iter(indices)

    def __len__(self) -> int:
        return self.num_samples


def steps_left(
    dataset_len: int,
    epoch: int,
    consumed: int,
    max_epochs: int,
    world_size: int,
    batch_size: int,
    drop_last: bool = False,
    drop_last_batch: bool = False,
) -> int:
    """Optimizer steps still to run from (``epoch``, ``consumed``) to the end of
    ``max_epochs`` if the world size stays ``world_size``. ``drop_last`` is the
    sampler's, ``drop_last_batch`` the data loader's (a short last batch is skipped)."""
    if epoch >= max_epochs:
        return 0

    def steps_for(remaining: int) -> int:
        per_rank = samples_per_rank(remaining, world_size, drop_last)
        return per_rank // batch_size if drop_last_batch else math.ceil(per_rank / batch_size)

    return steps_for(dataset_len - consumed) + (max_epochs - epoch - 1) * steps_for(dataset_len)
