"""What every built-in task's ``main`` shares: flags, logging and the run itself.

A task's flags come from its pydantic params model in ``contract.tasks`` (one flag per
field, kebab-case), plus the snapshot and output flags below, whose defaults come
from the ``RELAUNCH_SNAPSHOT_*`` environment the node agent sets.

A task runs in the process that was started (by torchrun, srun or plainly; see
``worker.runtime.env``), or with ``--nproc N`` starts its own world of N processes on
this machine (``worker.runtime.local_launch``), one per GPU where there are GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import Dataset

from contract.labels import label_from_environ
from contract.tasks import CommonParams, flag_name, get_task, validate_params
from worker.runtime.config import TrainerConfig
from worker.runtime.env import DistEnv, Launcher
from worker.runtime.local_launch import spawn_workers
from worker.runtime.model_prep import LossFn, OptimizerFactory, seed_everything
from worker.runtime.trainer import Trainer

logger = logging.getLogger(__name__)

P = TypeVar("P", bound=CommonParams)


@dataclass
class TaskParts:
    """What a task builds for the trainer; ``evaluate`` runs on rank 0 after a finished run,
    with the trained model on the CPU. ``drop_last_batch`` goes to ``TrainerConfig``."""

    model: nn.Module
    optimizer: OptimizerFactory
    dataset: Dataset
    loss_fn: LossFn
    evaluate: Callable[[nn.Module], None] | None = None
    drop_last_batch: bool = False


def _flag_type(name: str, annotation: object) -> Callable[[str], object]:
    if annotation is int or annotation is float or annotation is str:
        return annotation
    raise TypeError(f"param {name!r} has type {annotation!r}; task flags support int, float, str")


def build_parser(task: str) -> argparse.ArgumentParser:
    """The parser of task ``task``: its params as flags, then run settings."""
    info = get_task(task)
    parser = argparse.ArgumentParser(prog=f"python -m {info.module}", description=info.description)
    for name, field in info.params_model.model_fields.items():
        parser.add_argument(
            flag_name(name),
            dest=name,
            type=_flag_type(name, field.annotation),
            default=field.default,
            help=f"{field.description} (default: %(default)s)",
        )
    run = parser.add_argument_group("snapshots and output")
    run.add_argument("--snapshot-dir", help="default: $RELAUNCH_SNAPSHOT_DIR or ./snapshots")
    run.add_argument(
        "--snapshot-every-steps",
        type=int,
        help="snapshot after every N-th step; default: $RELAUNCH_SNAPSHOT_EVERY_STEPS or never",
    )
    run.add_argument(
        "--snapshot-every-epochs",
        type=int,
        help="snapshot after every N-th epoch (0: never); "
        "default: $RELAUNCH_SNAPSHOT_EVERY_EPOCHS or 1",
    )
    run.add_argument(
        "--snapshot-keep", type=int, help="snapshots kept; default: $RELAUNCH_SNAPSHOT_KEEP or 2"
    )
    run.add_argument(
        "--snapshot-async",
        type=int,
        choices=(0, 1),
        help="1: write snapshots in the background; default: $RELAUNCH_SNAPSHOT_ASYNC or 1",
    )
    run.add_argument("--output", help="final model path; default: <snapshot dir>/final.pt")
    run.add_argument(
        "--stop-after-steps",
        type=int,
        help="stop with a snapshot after this many global steps, unfinished (drills, tests)",
    )
    run.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    run.add_argument(
        "--nproc",
        type=_positive_int,
        help="start N processes on this machine (torch.multiprocessing.spawn), one per GPU "
        "where there are GPUs; not under torchrun or a multi-task srun. "
        "Default: train in this process",
    )
    return parser


def _positive_int(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_task_args(
    task: str, argv: Sequence[str] | None = None
) -> tuple[CommonParams, argparse.Namespace]:
    """Parse ``argv`` for ``task`` and validate its params (bounds as in ``contract.tasks``);
    exits with a usage error naming the bad flag's field otherwise."""
    info = get_task(task)
    parser = build_parser(task)
    args = parser.parse_args(argv)
    values = {name: getattr(args, name) for name in info.params_model.model_fields}
    try:
        params = validate_params(task, values)
    except ValueError as exc:
        parser.error(str(exc))
    return params, args


def trainer_config(
    params: CommonParams, args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> TrainerConfig:
    """The trainer's config: params and flags first, the environment for what is unset."""
    return TrainerConfig.from_environ(
        environ,
        max_epochs=params.epochs,
        batch_size=params.batch_size,
        lr=params.lr,
        seed=params.seed,
        step_delay_s=params.step_delay,
        freeze_at_step=params.freeze_at_step or None,
        freeze_rank=params.freeze_rank,
        log_every_steps=params.log_every_steps,
        snapshot_dir=args.snapshot_dir,
        snapshot_every_steps=args.snapshot_every_steps,
        snapshot_every_epochs=args.snapshot_every_epochs,
        snapshot_keep=args.snapshot_keep,
        snapshot_background=None if args.snapshot_async is None else bool(args.snapshot_async),
        snapshot_crash_at=params.crash_in_save or None,
        snapshot_crash_step=params.crash_in_save_step,
        output_path=args.output,
        stop_after_steps=args.stop_after_steps,
    )


def configure_logging(
    env: DistEnv, level: str = "INFO", environ: Mapping[str, str] = os.environ
) -> None:
    """Log to stderr with the job, attempt (when the agent set them) and global rank in
    every line: ``[job 3 attempt 2 rank 5]``."""
    label = label_from_environ(environ, rank=env.rank)
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s [{label}] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def run_task(
    task: str,
    params_type: type[P],
    build: Callable[[P], TaskParts],
    argv: Sequence[str] | None = None,
) -> int:
    """Parse flags, build the task with its seed set, train, evaluate; the exit status.
    With ``--nproc N``, all of that in each of N spawned processes."""
    params, args = parse_task_args(task, argv)
    if not isinstance(params, params_type):
        raise TypeError(f"task {task!r} params are {type(params).__name__}, not {params_type}")
    if args.nproc is not None:
        return _spawn(params, args, build)
    return _train(params, args, build)


def _spawn(params: P, args: argparse.Namespace, build: Callable[[P], TaskParts]) -> int:
    env = DistEnv.from_environ()
    configure_logging(env, args.log_level)
    if env.launcher is Launcher.TORCHRUN or env.world_size > 1:
        logger.error(
            "--nproc starts its own processes, but a launcher (%s) already started %d",
            env.launcher.value,
            env.world_size,
        )
        return 2
    if torch.cuda.is_available() and args.nproc > torch.cuda.device_count():
        logger.error(
            "--nproc %d is more than the %d GPUs here", args.nproc, torch.cuda.device_count()
        )
        return 2
    logger.info("starting %d processes", args.nproc)
    try:
        spawn_workers(_train_spawned, args.nproc, (params, args, build))
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        logger.error("a process failed: %s", exc)
        return 1
    return 0


def _train_spawned(params: P, args: argparse.Namespace, build: Callable[[P], TaskParts]) -> None:
    status = _train(params, args, build)
    if status != 0:
        sys.exit(status)


def _train(params: P, args: argparse.Namespace, build: Callable[[P], TaskParts]) -> int:
    env = DistEnv.from_environ()
    configure_logging(env, args.log_level)
    try:
        config = trainer_config(params, args)
    except ValueError as exc:
        logger.error("bad run settings: %s", exc)
        return 2
    seed_everything(params.seed)
    parts = build(params)
    config = dataclasses.replace(config, drop_last_batch=parts.drop_last_batch)
    trainer = Trainer(parts.model, parts.optimizer, parts.dataset, parts.loss_fn, config, env)
    result = trainer.train()
    if result.finished and env.rank == 0 and parts.evaluate is not None:
        parts.evaluate(trainer.model.cpu().eval())
    return 0
