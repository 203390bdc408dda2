"""Where a new attempt fits: pure answers about the room alive nodes have, for ``plan``.

A node is held by one attempt on "cpu" (the whole node) or by any number of
attempts on "cuda", each on GPUs of its own; unless told otherwise, only by attempts
of one owner (``CUDA_VISIBLE_DEVICES`` is no isolation between jobs on one node).
Nothing here reads a database.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
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


# Whose job holds a node or its GPUs: a user's id; None for a job without an owner.
Owner = int | None


@dataclass(frozen=True)
class Hold:
    """An ACTIVE membership on a node: the owner of its job, its attempt's device and the
    GPUs it holds (none on "cpu")."""

    owner: Owner
    device: Device
    gpus: tuple[int, ...] = ()


class GpuNodes:
    """How many of ``alive`` have at least so many GPUs, free or not, worked out once for
    each number asked (a deep queue asks the same few)."""

    def __init__(self, alive: Sequence[NodeRoom]) -> None:
        self._alive = alive
        self._counts: dict[int, int] = {}

    def enough(self, min_nodes: int, per_node: int) -> bool:
        """Whether at least ``min_nodes`` nodes have ``per_node`` GPUs each."""
        if per_node not in self._counts:
            self._counts[per_node] = sum(1 for n in self._alive if len(n.gpus) >= per_node)
        return self._counts[per_node] >= min_nodes


def stored_device(value: str | None) -> Device:
    """An attempt's stored device as placement reads it: "cuda", or else "cpu" (what rows
    from before devices were recorded hold)."""
    return "cuda" if value == "cuda" else "cpu"


def resolve_device(wanted: str, gpus_enough: bool) -> Device:
    """The device an attempt is placed for: ``JobSpec.device``, where "auto" is "cuda" if
    enough alive nodes have enough GPUs for it (``GpuNodes.enough``: it would not wait
    for ever) when the attempt is placed, else "cpu"."""
    if wanted == "auto":
        return "cuda" if gpus_enough else "cpu"
    if wanted not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {wanted!r}")
    return stored_device(wanted)


def gpu_waiting_reason(min_nodes: int, per_node: int, any_gpus: bool, gpus_exist: bool) -> str:
    """Why a job placed on GPUs is not placed: no alive node has GPUs (``any_gpus``
    false), fewer than ``min_nodes`` alive nodes have ``per_node`` GPUs at all
    (``gpus_exist`` false), or too few have that many free.

    Like the reason for nodes (``service.reconciler``), it names no count of nodes or
    GPUs, so it changes only when the job moves from one case to another."""
    gpus = "GPU" if per_node == 1 else "GPUs"
    needs = f"needs {min_nodes} {'node' if min_nodes == 1 else 'nodes'} with {per_node} free {gpus}"
    if min_nodes > 1:
        needs += " each"
    if not any_gpus:
        return f"waiting for GPUs: {needs}; no alive node has GPUs"
    which = "no alive node has" if min_nodes == 1 else "too few alive nodes have"
    if not gpus_exist:
        return f"waiting for GPUs: {needs}; {which} {per_node} {gpus}"
    which = "no node has" if min_nodes == 1 else "too few nodes have"
    return f"waiting for GPUs: {needs}; {which} {per_node} free {gpus}: other jobs hold them"


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
    then by id (or only those without GPUs, ``gpu_less``). On "cuda": the nodes that no
    attempt on "cpu" holds (``whole``) and no attempt of another owner holds (``owners``,
    by node; unless ``share``), with enough GPUs that no attempt holds (``held``, by
    node), those with the fewest free first (best fit: a job that fits a small node
    leaves a big one whole for a job that needs it), then by id; each gives its lowest
    free indices. Each question is worked out once; ``taking`` gives the room that is
    left."""

    def __init__(
        self,
        alive: Sequence[NodeRoom],
        whole: set[int],
        held: dict[int, set[int]],
        owners: dict[int, set[Owner]] | None = None,
        share: bool = False,
    ) -> None:
        self._alive = alive
        self._whole = whole
        self._held = held
        self._owners = {} if owners is None else owners
        self._share = share
        self._set_idle(
            sorted(
                (n for n in alive if n.id not in whole and n.id not in held),
                key=lambda n: (bool(n.gpus), n.id),
            )
        )
        self._free_gpus = {
            n.id: sorted(set(n.gpus) - held.get(n.id, set()))
            for n in alive
            if n.gpus and n.id not in whole
        }
        self._by_count: dict[tuple[int, Owner], list[Fit]] = {}

    def _set_idle(self, idle: list[NodeRoom]) -> None:
        """The nodes no attempt holds, in the order "cpu" takes them."""
        self._idle_nodes = idle
        self._idle = BySlots(idle)
        self._idle_gpu_less = BySlots([n for n in idle if not n.gpus])

    def is_full(self) -> bool:
        """Whether no attempt, on any device, of any owner and of any size, could take
        anything here: every node is held whole or has no GPU free."""
        return not self._idle_nodes and not any(self._free_gpus.values())

    def openings(self) -> int:
        """At most how many attempts this room could take: one on "cpu" for each node
        no attempt holds, one on "cuda" for each free GPU."""
        return len(self._idle_nodes) + sum(len(free) for free in self._free_gpus.values())

    def _free_for(self, owner: Owner) -> dict[int, list[int]]:
        """The free GPUs, by node, of the nodes an attempt of ``owner`` on "cuda" may share."""
        if self._share:
            return self._free_gpus
        return {
            i: free for i, free in self._free_gpus.items() if self._owners.get(i, set()) <= {owner}
        }

    def fitting(
        self, device: Device, per_node: int, owner: Owner = None, gpu_less: bool = False
    ) -> list[Fit]:
        """The nodes an attempt of ``owner`` on ``device`` with ``per_node`` workers may
        take, the ones it should take first first."""
        if device == "cpu":
            by_slots = self._idle_gpu_less if gpu_less else self._idle
            return [(i, ()) for i in by_slots.ids(per_node)]
        key = (per_node, None if self._share else owner)
        if key not in self._by_count:
            free_for = self._free_for(owner)
            fits = [(i, free) for i, free in free_for.items() if len(free) >= per_node]
            fits.sort(key=lambda fit: (len(fit[1]), fit[0]))
            self._by_count[key] = [(i, tuple(free[:per_node])) for i, free in fits]
        return self._by_count[key]

    def taking(
        self,
        device: Device,
        node_ids: Sequence[int],
        gpus: Sequence[Sequence[int]],
        owner: Owner = None,
    ) -> Room:
        if device == "cpu":
            # What is left of this room, without working it out again from every node: a
            # pass that places hundreds of jobs takes hundreds of rooms.
            whole = set(node_ids)
            room = copy.copy(self)
            room._whole = self._whole | whole
            room._set_idle([n for n in self._idle_nodes if n.id not in whole])
            room._free_gpus = {i: f for i, f in self._free_gpus.items() if i not in whole}
            room._by_count = {}
            return room
        held = dict(self._held)
        owners = dict(self._owners)
        for node_id, taken in zip(node_ids, gpus, strict=True):
            held[node_id] = held.get(node_id, set()) | set(taken)
            owners[node_id] = owners.get(node_id, set()) | {owner}
        return Room(self._alive, self._whole, held, owners, self._share)
