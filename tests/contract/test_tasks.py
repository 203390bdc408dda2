"""The task registry: validation, rendering, and no torch import."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from contract.tasks import TASKS, task_args, validate_params


def test_importable_without_torch(subprocess_env: dict[str, str]) -> None:
    code = (
        "import sys\n"
        "import contract.tasks as r\n"
        "r.task_args('charlm', {'epochs': 2})\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_unknown_task_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown task 'mnist'.*charlm, regression, spirals"):
        task_args("mnist", {})


@pytest.mark.parametrize(
    "task,params,field",
    [
        ("regression", {"epochs": 0}, "epochs"),
        ("regression", {"epochs": 1001}, "epochs"),
        ("regression", {"batch_size": 5000}, "batch_size"),
        ("regression", {"lr": 0}, "lr"),
        ("regression", {"step_delay": 11}, "step_delay"),
        ("regression", {"lr": "fast"}, "lr"),
        ("spirals", {"hidden": 1}, "hidden"),
        ("charlm", {"seq_len": 2}, "seq_len"),
        ("charlm", {"bogus": 1}, "bogus"),
        ("regression", {"hidden": 8}, "hidden"),  # a spirals field, not a regression one
    ],
)
def test_bad_params_name_the_field(task: str, params: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"invalid params for task '{task}': {field}:"):
        task_args(task, params)


def test_params_must_be_a_mapping() -> None:
    with pytest.raises(ValueError, match="mapping"):
        validate_params("regression", [("epochs", 1)])  # type: ignore[arg-type]


def test_renders_every_field_as_kebab_flags() -> None:
    args = task_args("regression", {"epochs": 3, "batch_size": 16, "lr": 0.02})
    pairs = dict(zip(args[::2], args[1::2], strict=True))
    assert pairs["--epochs"] == "3"
    assert pairs["--batch-size"] == "16"
    assert pairs["--lr"] == "0.02"
    assert pairs["--step-delay"] == "0.0"
    assert pairs["--samples"] == "2048"
    assert set(pairs) == {
        "--" + f.replace("_", "-") for f in TASKS["regression"].params_model.model_fields
    }


@pytest.mark.parametrize("task", sorted(TASKS))
def test_rendered_args_parse_back_in_the_task_module(task: str) -> None:
    from worker.tasks.cli import parse_task_args

    params = {"epochs": 2, "seed": 9, "step_delay": 0.25}
    parsed, args = parse_task_args(task, [*task_args(task, params), "--snapshot-dir", "/tmp/s"])
    assert parsed == validate_params(task, params)
    assert args.snapshot_dir == "/tmp/s"
    module = importlib.import_module(TASKS[task].module)
    assert callable(module.main)


def test_task_cli_rejects_out_of_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    from worker.tasks.cli import parse_task_args

    with pytest.raises(SystemExit):
        parse_task_args("regression", ["--epochs", "0"])
    assert "epochs" in capsys.readouterr().err
