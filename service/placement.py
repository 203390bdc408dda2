"""Where a new attempt fits: pure answers about the room alive nodes have, for ``plan``.

A node is held by one attempt on "cpu" (the whole node) or by any number of
attempts on "cuda", each on GPUs of its own. Nothing here reads a database.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol

from contract.protocol import Device


class NodeRoom(Protocol):
    """What placement reads of a node (``service.reconciler.NodeView``)."""

    @property
    def id(self) -> int: ...
    @property
    def slots(self) -> int: ...
    @property
    def gpus(self) -> tuple[int, ...]: ...


def resolve_device(wanted: str, any_gpus: bool) -> Device:
    """The device an attempt is placed for: ``JobSpec.device``, where "auto" is "cuda" if
    any alive node has GPUs (``any_gpus``) when the attempt is placed, else "cpu"."""
    if wanted == "auto":
        return "cuda" if any_gpus else "cpu"
    if wanted not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {wanted!r}")
    return "cuda" if wanted == "cuda" else "cpu"


def gpu_waiting_reason(
    min_nodes: int, per_node: int, fitting: int, with_gpus: int, most_free: int
) -> str:
    """Why a job placed on GPUs is not placed: ``fitting`` alive nodes have ``per_node``
    GPUs free, ``with_gpus`` alive nodes have any, the most free on one is ``most_free``.

    Like the reason for nodes (``service.reconciler``), the text depends only on these counts."""
    gpus = "GPU" if per_node == 1 else "GPUs"
    needs = f"needs {min_nodes} {'node' if min_nodes == 1 else 'nodes'} with {per_node} free {gpus}"
    if min_nodes > 1:
        needs += " each"
    if with_gpus == 0:
        return f"waiting for GPUs: {needs}; no alive node has GPUs"
    have = f"{with_gpus} alive {'node has' if with_gpus == 1 else 'nodes have'} GPUs"
    if fitting == 0:
        return (
            f"waiting for GPUs: {needs}; no node has {per_node} free {gpus} "
            f"({have}, the most free on one is {most_free})"
        )
    return (
        f"waiting for GPUs: {needs}; only {fitting} {'node has' if fitting == 1 else 'nodes have'} "
        f"{per_node} free {gpus} ({have})"
    )


class BySlots:
    """The ids of ``nodes`` with at least so many slots, in their order, worked out once
    for each number of slots asked."""

    def __init__(self, nodes: Sequence[NodeRoom]) -> None:
        self._nodes = nodes
        self._ids: dict[int, list[int]] = {}

    def ids(self, slots: int) -> list[int]:
        if slots not in self._ids:
            self._ids[slots] = [n.id for n in self._nodes if n.slots >= slots]
        return self._ids[slots]


# A node that may take an attempt, with the GPUs it would give it (none on "cpu").
Fit = tuple[int, tuple[int, ...]]


def by_id(
    device: Device, fits: Sequence[Fit]
) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """The node ids of ``fits`` by id, and on "cuda" each one's GPUs in the same order."""
    ordered = sorted(fits)
    gpus = tuple(g for _, g in ordered) if device == "cuda" else ()
    return tuple(i for i, _ in ordered), gpus


class Room:
    """What the alive nodes have free for a new attempt or member.

    On "cpu": the nodes no attempt holds with enough slots, those without GPUs first,
    then by id. On "cuda": the nodes that no attempt on "cpu" holds (``whole``) with
    enough GPUs that no attempt holds (``held``, by node), those with the fewest free
    first (best fit: a job that fits a small node leaves a big one whole for a job that
    needs it), then by id; each gives its lowest free indices. Each question is worked
    out once; ``taking`` gives the room that is left."""

    def __init__(
        self, alive: Sequence[NodeRoom], whole: set[int], held: dict[int, set[int]]
    ) -> None:
        self._alive = alive
        self._whole = whole
        self._held = held
        idle = [n for n in alive if n.id not in whole and n.id not in held]
        self._idle = BySlots(sorted(idle, key=lambda n: (bool(n.gpus), n.id)))
        self._free_gpus = {
            n.id: sorted(set(n.gpus) - held.get(n.id, set()))
            for n in alive
            if n.gpus and n.id not in whole
        }
        self._by_count: dict[int, list[Fit]] = {}

    def fitting(self, device: Device, per_node: int) -> list[Fit]:
        """The nodes an attempt on ``device`` with ``per_node`` workers may take, the ones
        it should take first first."""
        if device == "cpu":
            return [(i, ()) for i in self._idle.ids(per_node)]
        if per_node not in self._by_count:
            fits = [(i, free) for i, free in self._free_gpus.items() if len(free) >= per_node]
            fits.sort(key=lambda fit: (len(fit[1]), fit[0]))
            self._by_count[per_node] = [(i, tuple(free[:per_node])) for i, free in fits]
        return self._by_count[per_node]

    @functools.cached_property
    def most_free(self) -> int:
        """The most GPUs free on one node that may take an attempt on "cuda"."""
        return max((len(free) for free in self._free_gpus.values()), default=0)

    def taking(
        self, device: Device, node_ids: Sequence[int], gpus: Sequence[Sequence[int]]
    ) -> Room:
        if device == "cpu":
            return Room(self._alive, self._whole | set(node_ids), self._held)
        held = dict(self._held)
        for node_id, taken in zip(node_ids, gpus, strict=True):
            held[node_id] = held.get(node_id, set()) | set(taken)
        return Room(self._alive, self._whole, held)
