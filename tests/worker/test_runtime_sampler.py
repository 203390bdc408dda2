"""ResumableDistributedSampler: pure index math, no process group."""

from __future__ import annotations

from collections import Counter

import pytest
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

from worker.runtime.sampler import ResumableDistributedSampler, deal_indices, steps_left


class Indices(Dataset[int]):
    """A stand-in dataset: only its length matters to a sampler."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def rank_indices(
    n: int, world: int, epoch: int, consumed: int = 0, seed: int = 7, drop_last: bool = False
) -> list[list[int]]:
    out = []
    for rank in range(world):
        sampler = ResumableDistributedSampler(
            Indices(n), num_replicas=world, rank=rank, seed=seed, drop_last=drop_last
        )
        sampler.set_epoch(epoch, consumed=consumed)
        indices = list(sampler)
        assert len(indices) == len(sampler)
        out.append(indices)
    return out


def first_batches(per_rank: list[list[int]], batches: int, batch_size: int) -> list[int]:
    return [i for indices in per_rank for i in indices[: batches * batch_size]]


@pytest.mark.parametrize("n,world", [(100, 1), (100, 3), (101, 4), (7, 2), (5, 8)])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_fresh_epoch_matches_distributed_sampler(
    n: int, world: int, drop_last: bool, shuffle: bool
) -> None:
    for rank in range(world):
        theirs: DistributedSampler[int] = DistributedSampler(
            Indices(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=3, drop_last=drop_last
        )
        ours = ResumableDistributedSampler(
            Indices(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=3, drop_last=drop_last
        )
        theirs.set_epoch(5)
        ours.set_epoch(5)
        assert list(ours) == list(theirs)
        assert len(ours) == len(theirs)


def test_consumed_prefix_is_world_size_independent() -> None:
    n, world, batch, k = 120, 3, 4, 5
    sampler = ResumableDistributedSampler(Indices(n), num_replicas=1, rank=0, seed=7)
    sampler.set_epoch(2)
    perm = sampler.permutation()
    seen = first_batches(rank_indices(n, world, epoch=2), k, batch)
    assert sorted(seen) == sorted(perm[: k * batch * world])


def test_resume_at_same_world_size_is_exact() -> None:
    n, world, batch, k = 96, 2, 6, 3
    full = rank_indices(n, world, epoch=1)
    resumed = rank_indices(n, world, epoch=1, consumed=k * batch * world)
    for rank in range(world):
        assert resumed[rank] == full[rank][k * batch :]


@pytest.mark.parametrize(
    "n,old_world,new_world,batch,k",
    [(120, 2, 3, 3, 5), (120, 4, 1, 5, 2), (120, 3, 2, 2, 7), (96, 1, 4, 8, 3)],
)
def test_resume_at_new_world_size_covers_epoch_once(
    n: int, old_world: int, new_world: int, batch: int, k: int
) -> None:
    consumed = k * batch * old_world
    assert (n - consumed) % new_world == 0, "chosen so that no padding is needed"
    before = first_batches(rank_indices(n, old_world, epoch=4), k, batch)
    after = [
        i for indices in rank_indices(n, new_world, epoch=4, consumed=consumed) for i in indices
    ]
    counts = Counter(before + after)
    assert set(counts) == set(range(n))
    assert max(counts.values()) == 1


def test_resume_with_padding_repeats_only_the_padding() -> None:
    n, old_world, new_world, batch, k = 50, 2, 3, 4, 3  # 26 remain, padded to 27
    consumed = k * batch * old_world
    before = first_batches(rank_indices(n, old_world, epoch=0), k, batch)
    resumed = rank_indices(n, new_world, epoch=0, consumed=consumed)
    assert {len(r) for r in resumed} == {9}
    counts = Counter(before + [i for r in resumed for i in r])
    assert set(counts) == set(range(n))
    assert sum(c - 1 for c in counts.values()) == 1


def test_resume_with_drop_last_truncates() -> None:
    resumed = rank_indices(50, 3, epoch=0, consumed=24, drop_last=True)  # 26 remain → 24
    flat = [i for r in resumed for i in r]
    assert {len(r) for r in resumed} == {8}
    assert len(set(flat)) == 24


def test_fully_consumed_epoch_yields_nothing() -> None:
    assert rank_indices(10, 3, epoch=0, consumed=10) == [[], [], []]


def test_fewer_remaining_than_ranks_pads_every_rank() -> None:
    perm = list(range(10))
    shares = [deal_indices(perm, 9, 3, rank, drop_last=False) for rank in range(3)]
    assert shares == [[9], [9], [9]]


@pytest.mark.parametrize("consumed", [-1, 11])
def test_consumed_out_of_range_is_rejected(consumed: int) -> None:
    sampler = ResumableDistributedSampler(Indices(10), num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="consumed"):
        sampler.set_epoch(0, consumed=consumed)


def test_steps_left_counts_partial_epoch_then_full_ones() -> None:
    # 100 samples, world 2, batch 8: 50 per rank → 7 steps per epoch
    assert steps_left(100, epoch=0, consumed=0, max_epochs=3, world_size=2, batch_size=8) == 21
    # 48 consumed: 52 remain → 26 per rank → 4 steps, then 1 full epoch
    assert steps_left(100, epoch=1, consumed=48, max_epochs=3, world_size=2, batch_size=8) == 11
    assert steps_left(100, epoch=3, consumed=0, max_epochs=3, world_size=2, batch_size=8) == 0


def test_steps_left_without_short_last_batches() -> None:
    # 50 per rank in batches of 8: 6 full batches, the short one (2) is skipped
    assert steps_left(100, 0, 0, 3, 2, 8, drop_last_batch=True) == 18
