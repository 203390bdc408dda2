"""``TrainerConfig``: how long to train and when to snapshot and report.

The node agent passes the snapshot settings through the environment
(``RELAUNCH_SNAPSHOT_DIR``, ``RELAUNCH_SNAPSHOT_EVERY_STEPS``,
``RELAUNCH_SNAPSHOT_EVERY_EPOCHS``); ``TrainerConfig.from_environ`` fills them in
where the caller gave no explicit value.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.paths import is_url
from contract.protocol import (
    SNAPSHOT_ASYNC_ENV,
    SNAPSHOT_DIR_ENV,
    SNAPSHOT_EVERY_EPOCHS_ENV,
    SNAPSHOT_EVERY_STEPS_ENV,
    SNAPSHOT_KEEP_ENV,
)
from worker.runtime.snapshot import FAULT_POINTS

DEFAULT_SNAPSHOT_DIR = "./snapshots"


def _optional_count(environ: Mapping[str, str], name: str) -> int | None:
    raw = (environ.get(name) or "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"environment variable {name} must be >= 0, got {value}")
    return value


@dataclass(frozen=True)
class TrainerConfig:
    """Settings of one training run.

    ``batch_size`` is per rank. A snapshot is taken after every
    ``snapshot_every_steps``-th global step and after every
    ``snapshot_every_epochs``-th epoch (``None`` or 0 turns either off), and
    always once at the end. ``stop_after_steps`` ends ``train()`` early, with a
    snapshot, once that many global steps are done (for drills and tests); the
    run then counts as unfinished and writes no final model. ``drop_last_batch``
    skips each rank's short last batch of an epoch (BatchNorm cannot train on a
    batch of one). ``freeze_at_step`` is a drill for hang detection: global rank
    ``freeze_rank`` stops making progress after that step, once per job (a
    marker file in the snapshot directory remembers that it did).
    """

    max_epochs: int
    batch_size: int
    lr: float
    seed: int = 0
    snapshot_every_steps: int | None = None
    snapshot_every_epochs: int | None = 1
    snapshot_dir: str = DEFAULT_SNAPSHOT_DIR
    snapshot_keep: int = 2
    snapshot_background: bool = True  # write in a thread; from_environ: RELAUNCH_SNAPSHOT_ASYNC
    log_every_steps: int = 10
    step_delay_s: float = 0.0
    output_path: str | None = None
    stop_after_steps: int | None = None
    drop_last_batch: bool = False
    freeze_at_step: int | None = None
    freeze_rank: int = 0
    snapshot_crash_at: str | None = None
    snapshot_crash_step: int | None = None

    def __post_init__(self) -> None:
        if self.max_epochs < 1:
            raise ValueError(f"max_epochs must be >= 1, got {self.max_epochs}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.log_every_steps < 1:
            raise ValueError(f"log_every_steps must be >= 1, got {self.log_every_steps}")
        if self.step_delay_s < 0:
            raise ValueError(f"step_delay_s must be >= 0, got {self.step_delay_s}")
        if self.snapshot_keep < 1:
            raise ValueError(f"snapshot_keep must be >= 1, got {self.snapshot_keep}")
        for name in ("snapshot_every_steps", "snapshot_every_epochs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {value}")
        if self.snapshot_crash_at is not None and self.snapshot_crash_at not in FAULT_POINTS:
            raise ValueError(f"snapshot_crash_at must be one of {FAULT_POINTS}")
        if self.stop_after_steps is not None and self.stop_after_steps < 1:
            raise ValueError(f"stop_after_steps must be >= 1 or None, got {self.stop_after_steps}")

    @property
    def final_output_path(self) -> str:
        """Where the final model goes: ``output_path`` or ``<snapshot_dir>/final.pt``."""
        if self.output_path:
            return self.output_path
        if is_url(self.snapshot_dir):
            return f"{self.snapshot_dir.rstrip('/')}/final.pt"
        return str(Path(self.snapshot_dir) / "final.pt")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ, **fields: Any) -> TrainerConfig:
        """A config whose snapshot settings that are missing or ``None`` in ``fields``
        come from ``environ``.

        Precedence: an explicit value, then the ``RELAUNCH_SNAPSHOT_*`` variable,
        then the default (``./snapshots``; with neither interval set, every epoch and no
        step snapshots; with only a step interval, no epoch snapshots). Raises
        ``ValueError`` naming a variable that is not a count >= 0.
        """
        if fields.get("snapshot_dir") is None:
            fields["snapshot_dir"] = environ.get(SNAPSHOT_DIR_ENV) or DEFAULT_SNAPSHOT_DIR
        if fields.get("snapshot_every_steps") is None:
            fields["snapshot_every_steps"] = _optional_count(environ, SNAPSHOT_EVERY_STEPS_ENV)
        if fields.get("snapshot_keep") is None:
            keep = _optional_count(environ, SNAPSHOT_KEEP_ENV)
            fields["snapshot_keep"] = 2 if keep is None else keep
        if fields.get("snapshot_background") is None:
            raw = (environ.get(SNAPSHOT_ASYNC_ENV) or "1").strip().lower()
            if raw not in ("0", "1", "true", "false"):
                raise ValueError(f"environment variable {SNAPSHOT_ASYNC_ENV}={raw!r} is not 0 or 1")
            fields["snapshot_background"] = raw in ("1", "true")
        if fields.get("snapshot_every_epochs") is None:
            env_epochs = _optional_count(environ, SNAPSHOT_EVERY_EPOCHS_ENV)
            if env_epochs is None:
                # Every epoch is the default only when no step interval was asked for:
                # ``every_steps: 20`` alone means every 20 steps, not also every epoch.
                env_epochs = 0 if fields["snapshot_every_steps"] else 1
            fields["snapshot_every_epochs"] = env_epochs
        return cls(**fields)
