"""The built-in tasks, their parameters and their command lines, without torch.

The controller imports this module to validate a job spec before it places the
job, so it must not import torch (nor anything that does). Each task's
parameters are a pydantic model with bounds; ``task_args`` validates a params
dict and renders it as the task module's argparse flags (``batch_size`` →
``--batch-size 32``). The task modules build their parsers from the same models
(``worker.tasks.cli``), so a rendered command line always parses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class CommonParams(BaseModel):
    """Parameters every built-in task takes."""

    model_config = ConfigDict(extra="forbid")

    epochs: int = Field(default=5, ge=1, le=1000, description="epochs to train")
    batch_size: int = Field(default=32, ge=1, le=4096, description="batch size per rank")
    lr: float = Field(default=0.05, gt=0, le=10, description="learning rate")
    seed: int = Field(default=0, ge=0, le=2**31 - 1, description="seed of init and data order")
    step_delay: float = Field(
        default=0.0, ge=0, le=10, description="seconds to sleep after each step (for drills)"
    )
    log_every_steps: int = Field(
        default=10, ge=1, le=100_000, description="steps between progress reports"
    )
    freeze_at_step: int = Field(
        default=0,
        ge=0,
        le=10**9,
        description="drill: freeze rank freeze_rank after this step, once per job (0: never)",
    )
    freeze_rank: int = Field(default=0, ge=0, le=65535, description="rank the drill freezes")
    crash_in_save: str = Field(
        default="",
        pattern=r"^(|during_write|before_rename|before_manifest)$",
        description="drill: SIGKILL rank 0 at this point of the save at crash_in_save_step, "
        "once per job ('' : never)",
    )
    crash_in_save_step: int = Field(
        default=0, ge=0, le=10**9, description="step whose save the crash drill interrupts"
    )


class RegressionParams(CommonParams):
    """Linear regression on generated data y = X·w + b + noise."""

    samples: int = Field(default=2048, ge=16, le=1_000_000, description="generated samples")
    features: int = Field(default=20, ge=1, le=1024, description="input features")
    noise: float = Field(default=0.1, ge=0, le=10, description="std of the label noise")


class SpiralsParams(CommonParams):
    """Two interleaved spirals classified by an MLP with BatchNorm."""

    lr: float = Field(default=0.01, gt=0, le=10, description="learning rate (Adam)")
    epochs: int = Field(default=20, ge=1, le=1000, description="epochs to train")
    batch_size: int = Field(
        default=32, ge=2, le=4096, description="batch size per rank (BatchNorm needs 2)"
    )
    samples: int = Field(default=2048, ge=16, le=1_000_000, description="generated points")
    hidden: int = Field(default=64, ge=2, le=4096, description="hidden units per layer")
    noise: float = Field(default=0.1, ge=0, le=5, description="jitter, relative to the radius")
    turns: float = Field(default=1.5, gt=0, le=10, description="turns of each spiral")


class CharLMParams(CommonParams):
    """A character-level GRU language model on generated arithmetic lines."""

    lr: float = Field(default=0.01, gt=0, le=10, description="learning rate (Adam)")
    epochs: int = Field(default=20, ge=1, le=1000, description="epochs to train")
    lines: int = Field(default=4000, ge=16, le=1_000_000, description="generated corpus lines")
    seq_len: int = Field(default=64, ge=4, le=1024, description="characters per training sample")
    hidden: int = Field(default=128, ge=4, le=2048, description="GRU hidden units")
    embed: int = Field(default=32, ge=2, le=1024, description="character embedding size")
    max_operand: int = Field(default=99, ge=1, le=1_000_000, description="largest operand")


@dataclass(frozen=True)
class TaskInfo:
    """A built-in task: run ``python -m {module} {task_args(...)}`` under torchrun."""

    name: str
    module: str
    params_model: type[CommonParams]
    description: str


TASKS: dict[str, TaskInfo] = {
    info.name: info
    for info in (
        TaskInfo(
            "regression",
            "worker.tasks.regression",
            RegressionParams,
            "Linear regression on generated data (SGD, MSE): the DDP tutorial, with a target",
        ),
        TaskInfo(
            "spirals",
            "worker.tasks.spirals",
            SpiralsParams,
            "Two-spirals classification with an MLP with BatchNorm (Adam, cross-entropy)",
        ),
        TaskInfo(
            "charlm",
            "worker.tasks.charlm",
            CharLMParams,
            "Character-level GRU language model on generated arithmetic lines (nats/char)",
        ),
    )
}


def flag_name(field: str) -> str:
    """``batch_size`` → ``--batch-size``."""
    return "--" + field.replace("_", "-")


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(loc) for loc in item["loc"]) or "params"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


def get_task(name: str) -> TaskInfo:
    """The task called ``name``; ``ValueError`` listing the known ones if none is."""
    try:
        return TASKS[name]
    except KeyError:
        known = ", ".join(sorted(TASKS))
        raise ValueError(f"unknown task {name!r}; known tasks: {known}") from None


def validate_params(name: str, params: Mapping[str, Any]) -> CommonParams:
    """``params`` checked against task ``name``'s model, defaults filled in.

    Raises ``ValueError`` for an unknown task, or naming each bad or unknown field
    (e.g. ``"invalid params for task 'regression': epochs: Input should be less
    than or equal to 1000"``).
    """
    info = get_task(name)
    if not isinstance(params, Mapping):
        raise ValueError(f"params for task {name!r} must be a mapping")
    try:
        return info.params_model.model_validate(dict(params))
    except ValidationError as exc:
        raise ValueError(f"invalid params for task {name!r}: {_describe(exc)}") from None


def render_args(params: BaseModel) -> list[str]:
    """Every field of ``params`` as ``--flag value``, in declaration order."""
    args: list[str] = []
    for field in type(params).model_fields:
        args += [flag_name(field), str(getattr(params, field))]
    return args


def task_args(name: str, params: Mapping[str, Any]) -> list[str]:
    """The validated ``params`` of task ``name`` as its module's command-line flags.

    All fields are rendered, defaults included, so the command line alone fixes
    the run. Raises ``ValueError`` as ``validate_params`` does.
    """
    return render_args(validate_params(name, params))
