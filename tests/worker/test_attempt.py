import json
from datetime import UTC, datetime
from pathlib import Path
from string import Template

import pytest

from contract.events import LauncherExited, TrainingProgress, runtime_event
from contract.protocol import Assignment, Entrypoint, LogLine, RendezvousConfig
from worker import attempt as attempt_module
from worker.attempt import (
    LOG_LINE_PREFIX_TEMPLATE,
    Attempt,
    attempt_label,
    attempt_marker,
    build_launcher_env,
    build_torchrun_args,
    parse_console_line,
    working_dir_for,
    write_private,
)
from worker.outbox import EventsTail, LogOutbox
from worker.settings import AgentSettings

CTL = "http://ctl:8080"


def _assignment(**overrides: object) -> Assignment:
    fields: dict[str, object] = {
        "attempt_id": 12,
        "job_id": 3,
        "min_nodes": 1,
        "max_nodes": 4,
        "nproc_per_node": 2,
        "restart": {"max_restarts": 5},
        "rendezvous": RendezvousConfig(
            rdzv_id="job-3-attempt-12",
            last_call_timeout_s=2,
            join_timeout_s=600,
            keep_alive_interval_s=2,
            keep_alive_max_attempt=3,
        ),
        "entrypoint": Entrypoint(module="pkg.train", args=["--epochs", "3"]),
        "env": {"FOO": "bar", "RELAUNCH_ATTEMPT_ID": "spoofed"},
        "snapshot_dir": "/snap/3",
    }
    fields.update(overrides)
    return Assignment.model_validate(fields)


def test_torchrun_args_for_a_module() -> None:
    args = build_torchrun_args(
        _assignment(), local_addr="10.0.0.7", log_dir=Path("/w/logs"), controller_url=CTL
    )
    assert args == [
        "--nnodes", "1:4",
        "--nproc-per-node", "2",
        "--rdzv-backend", "relaunch",
        "--rdzv-endpoint", "http://ctl:8080",
        "--rdzv-id", "job-3-attempt-12",
        "--rdzv-conf",
        "last_call_timeout=2,join_timeout=600,"
        "keep_alive_interval=2,keep_alive_max_attempt=3",
        "--max-restarts", "5",
        "--monitor-interval", "0.2",
        "--local-addr", "10.0.0.7",
        "--tee", "3",
        "--log-dir", "/w/logs",
        "-m", "worker.bootstrap", "-m", "pkg.train", "--epochs", "3",
    ]  # fmt: skip


def test_a_jobs_env_reaches_workers_by_environment_never_the_command_line(
    tmp_path: Path,
) -> None:
    job = _assignment(env={"HF_TOKEN": "hf_s3cret"})
    args = build_torchrun_args(
        job, local_addr="10.0.0.7", log_dir=Path("/w/logs"), controller_url=CTL
    )
    assert not any("hf_s3cret" in a for a in args)
    settings = AgentSettings(enrolment_token="t", controller_url="http://c:1", work_dir=tmp_path)
    env = build_launcher_env(job, settings=settings, events_file=tmp_path / "e", base_env={})
    assert env["HF_TOKEN"] == "hf_s3cret"


def test_torchrun_args_accepted_by_torchrun_parser() -> None:
    from torch.distributed.run import parse_args

    args = build_torchrun_args(
        _assignment(), local_addr="10.0.0.7", log_dir=Path("/w/logs"), controller_url=CTL
    )
    ns = parse_args(args)
    assert ns.module and ns.training_script == "worker.bootstrap"
    assert ns.training_script_args == ["-m", "pkg.train", "--epochs", "3"]
    assert ns.tee == "3" and ns.nnodes == "1:4" and ns.max_restarts == 5


def test_torchrun_args_for_a_script() -> None:
    entry = Entrypoint(script="/code/train.py", args=["-x"])
    args = build_torchrun_args(
        _assignment(entrypoint=entry), local_addr="a", log_dir=Path("/l"), controller_url=CTL
    )
    assert args[-4:] == ["-m", "worker.bootstrap", "/code/train.py", "-x"]


@pytest.mark.parametrize(
    "entry", [Entrypoint(), Entrypoint(module="m", script="s.py")], ids=["none", "both"]
)
def test_entrypoint_needs_exactly_one(entry: Entrypoint) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        build_torchrun_args(
            _assignment(entrypoint=entry), local_addr="a", log_dir=Path("/l"), controller_url=CTL
        )


def test_launcher_env(tmp_path: Path) -> None:
    settings = AgentSettings(
        enrolment_token="t",
        controller_url="http://c:1",
        name="node-a",
        work_dir=tmp_path / "agent",
        stop_grace_s=5,
    )
    base = {
        "PATH": "/bin",
        "PET_TEE": "0",
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "x",
        "RELAUNCH_AGENT_ENROLMENT_TOKEN": "node-secret",
        "RELAUNCH_AGENT_CONTROLLER_URL": "http://c:1",
        "RELAUNCH_ENROLMENT_TOKEN": "node-secret",
        "RELAUNCH_TOKEN": "rlu_user",
        "DATABASE_URL": "postgresql://u:pw@db/relaunch",
        "RELAUNCH_SECRETS_KEYS": "the-controllers-key",
        "RELAUNCH_SECRETS_KEY_FILE": "/etc/relaunch/secrets.key",
    }
    env = build_launcher_env(
        _assignment(snapshot_every_steps=10, attempt_number=2, worker_token="rlw_worker"),
        settings=settings,
        events_file=tmp_path / "ev.jsonl",
        base_env=base,
    )
    assert env["PATH"] == "/bin" and env["FOO"] == "bar"
    assert "PET_TEE" not in env
    # The workers' line prefix is ours: it carries the global rank.
    assert env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == LOG_LINE_PREFIX_TEMPLATE
    # The job's code never sees the node's credentials or the controller's database.
    assert not {k for k in env if k.startswith("RELAUNCH_AGENT_")}
    assert not {"RELAUNCH_ENROLMENT_TOKEN", "RELAUNCH_TOKEN", "DATABASE_URL"} & set(env)
    assert not {k for k in env if k.startswith("RELAUNCH_SECRETS_")}
    assert "node-secret" not in env.values()
    assert env["RELAUNCH_JOB_ID"] == "3"
    assert env["RELAUNCH_ATTEMPT_ID"] == "12"  # ours wins over assignment.env
    assert env["RELAUNCH_ATTEMPT_NUMBER"] == "2"  # the job's own number, for log labels
    assert env["RELAUNCH_NODE_NAME"] == "node-a"
    assert env["RELAUNCH_NODE_AGENT_DIR"] == str(settings.work_dir.resolve())
    assert env["RELAUNCH_SNAPSHOT_DIR"] == "/snap/3"
    assert env["RELAUNCH_SNAPSHOT_EVERY_STEPS"] == "10"
    assert "RELAUNCH_SNAPSHOT_EVERY_EPOCHS" not in env
    assert env["RELAUNCH_EVENTS_FILE"] == str(tmp_path / "ev.jsonl")
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "4"
    assert env["RELAUNCH_CONTROLLER_URL"] == "http://c:1"
    assert env["RELAUNCH_WORKER_TOKEN"] == "rlw_worker"  # the attempt's, for the fence
    assert env["GLOO_SOCKET_IFNAME"] == "lo"  # the interface of the agent's 127.0.0.1
    assert env["PYTHONUNBUFFERED"] == "1"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("[default0 rank2]:hello", (0, 2, "hello")),
        ("[default1 rank13]:[default0 rank1]:x", (1, 13, "[default0 rank1]:x")),
        ("[default2 rank2]:", (2, 2, "")),
        ("[default0]:torch's own prefix", (0, None, "torch's own prefix")),
        ("W1122 11:06 run.py:874] warn", (None, None, "W1122 11:06 run.py:874] warn")),
        ("[trainer0 rank0]:other role", (None, None, "[trainer0 rank0]:other role")),
        (" [default0 rank0]:indented", (None, None, " [default0 rank0]:indented")),
        ("[default0 rank]:no number", (None, None, "[default0 rank]:no number")),
    ],
)  # fmt: skip
def test_parse_console_line(raw: str, expected: tuple[int | None, int | None, str]) -> None:
    assert parse_console_line(raw) == expected


def test_the_prefix_torch_renders_from_our_template_parses_back() -> None:
    # torch fills the template in with string.Template (LocalElasticAgent._start_workers).
    header = Template(LOG_LINE_PREFIX_TEMPLATE).safe_substitute(
        role_name="default", rank=5, local_rank=1
    )
    assert parse_console_line(header + "step 3") == (1, 5, "step 3")


def test_the_agent_names_an_attempt_by_the_jobs_own_number() -> None:
    assert attempt_label(_assignment(attempt_number=2)) == "job 3 attempt 2"
    assert attempt_label(_assignment()) == "job 3 attempt id 12"


def _line(text: str) -> LogLine:
    return LogLine(time=datetime.now(UTC), line=text)


def test_outbox_keeps_lines_until_committed() -> None:
    box = LogOutbox()
    for i in range(5):
        box.put(_line(str(i)))
    first = box.peek(3)
    assert [x.line for x in first.lines] == ["0", "1", "2"] and not first.complete
    again = box.peek(3)  # not committed: the same batch comes back
    assert [x.line for x in again.lines] == ["0", "1", "2"]
    box.commit(first)
    box.put(_line("5"))
    rest = box.peek(10)
    assert [x.line for x in rest.lines] == ["3", "4", "5"] and rest.complete


def test_outbox_batches_are_bounded_in_size() -> None:
    box = LogOutbox()
    for text in ["a" * 10, "b" * 10, "c" * 10]:
        box.put(_line(text))
    assert [x.line for x in box.peek(10, max_chars=25).lines] == ["a" * 10, "b" * 10]
    assert len(box.peek(10, max_chars=5).lines) == 1  # always makes progress


def test_outbox_caps_memory_and_says_so() -> None:
    box = LogOutbox(max_lines=3)
    for i in range(5):
        box.put(_line(str(i)))
    batch = box.peek(10)
    assert "2 log lines dropped" in batch.lines[0].line
    assert [x.line for x in batch.lines[1:]] == ["2", "3", "4"]
    box.commit(batch)
    assert box.peek(10).lines == []


def test_events_tail_reads_complete_lines_from_the_delivered_offset(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    tail = EventsTail(path)
    assert tail.peek(10).events == []

    def event(step: int) -> str:
        ev = runtime_event(TrainingProgress(step=step), datetime.now(UTC))
        return ev.model_dump_json() + "\n"

    path.write_text(event(1) + "not json\n" + event(2) + event(3)[:10])
    batch = tail.peek(10)
    assert [e.data.step for e in batch.events] == [1, 2]
    assert batch.complete is False  # a partial line is pending
    tail.commit(batch)
    with path.open("a") as fp:
        fp.write(event(3)[10:] + event(4))
    first = tail.peek(1)
    assert [e.data.step for e in first.events] == [3]
    tail.commit(first)
    last = tail.peek(10)
    assert [e.data.step for e in last.events] == [4] and last.complete


def test_events_tail_finds_the_launcher_exit(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    lines = [
        {"time": "2026-01-01T00:00:00Z", "kind": "rendezvous", "data": {}},
        {"time": "2026-01-01T00:00:01Z", "kind": "launcher_exit", "data": {"message": "m"}},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    found = EventsTail(path).last_of(LauncherExited)
    assert found is not None and found.message == "m"
    assert EventsTail(tmp_path / "none").last_of(LauncherExited) is None


def test_markers_of_two_agents_with_one_node_name_differ(tmp_path: Path) -> None:
    one = AgentSettings(
        enrolment_token="t", controller_url="http://c:1", name="node-a", work_dir=tmp_path / "1"
    )
    two = AgentSettings(
        enrolment_token="t", controller_url="http://c:2", name="node-a", work_dir=tmp_path / "2"
    )
    assert attempt_marker(one, 1) != attempt_marker(two, 1)
    assert attempt_marker(one, 1)["RELAUNCH_ATTEMPT_ID"] == "1"


def _settings(tmp_path: Path) -> AgentSettings:
    return AgentSettings(
        enrolment_token="t", controller_url="http://c:1", name="node-a", work_dir=tmp_path / "a"
    )


def test_workers_run_in_the_jobs_working_dir_else_in_its_shared_snapshot_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempt_dir = tmp_path / "attempts" / "12"
    given = _assignment(working_dir="/data/runs/exp1")
    assert working_dir_for(given, attempt_dir) == Path("/data/runs/exp1")
    assert working_dir_for(_assignment(), attempt_dir) == Path("/snap/3")
    # A URL is no directory the nodes share: a directory of the node's attempt, absolute
    # (the attempt's own is root's; this one the job's).
    monkeypatch.chdir(tmp_path)
    on_s3 = _assignment(snapshot_dir="s3://bucket/relaunch/job-3")
    assert working_dir_for(on_s3, Path("attempts/12")) == attempt_dir / "work"
    relative = _assignment(snapshot_dir="snaps/job-3")
    assert working_dir_for(relative, attempt_dir) == tmp_path / "snaps" / "job-3"


def test_a_relative_snapshot_dir_reaches_the_workers_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The workers do not run in the agent's directory, which a relative path means.
    monkeypatch.chdir(tmp_path)
    env = build_launcher_env(
        _assignment(snapshot_dir="snaps/job-3"),
        settings=_settings(tmp_path),
        events_file=tmp_path / "ev.jsonl",
        base_env={},
    )
    assert env["RELAUNCH_SNAPSHOT_DIR"] == str(tmp_path / "snaps" / "job-3")
    on_s3 = _assignment(snapshot_dir="s3://bucket/job-3")
    url_env = build_launcher_env(
        on_s3, settings=_settings(tmp_path), events_file=tmp_path / "e", base_env={}
    )
    assert url_env["RELAUNCH_SNAPSHOT_DIR"] == "s3://bucket/job-3"


def test_the_launcher_starts_in_the_working_dir_with_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, object] = {}

    def popen(command: list[str], **kwargs: object) -> None:
        seen.update(kwargs, command=command)
        raise OSError("not started in this test")

    monkeypatch.setattr(attempt_module.subprocess, "Popen", popen)
    monkeypatch.chdir(tmp_path)
    settings = AgentSettings(
        enrolment_token="t", controller_url="http://c:1", name="node-a", work_dir=Path("agent")
    )
    workdir = tmp_path / "runs"
    workdir.mkdir()
    attempt = Attempt(_assignment(working_dir=str(workdir)), settings)
    attempt.start()
    assert seen["cwd"] == workdir
    command = seen["command"]
    assert isinstance(command, list)
    events_file = command[command.index("--events-file") + 1]
    assert events_file == str(tmp_path / "agent" / "attempts" / "12" / "events.jsonl")
    log_dir = command[command.index("--log-dir") + 1]
    assert Path(log_dir).is_absolute()
    assert attempt.exit is not None and not attempt.exit.fatal  # a plain start failure


def test_the_launcher_is_told_the_hang_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commands: list[list[str]] = []

    def popen(command: list[str], **kwargs: object) -> None:
        commands.append(command)
        raise OSError("not started in this test")

    monkeypatch.setattr(attempt_module.subprocess, "Popen", popen)
    settings = AgentSettings(enrolment_token="t", controller_url="http://c:1", work_dir=tmp_path)
    for fields in (
        {"hang_timeout_s": 600, "hang_timeout_adaptive": True},
        {"hang_timeout_s": 45},
        {"hang_timeout_s": None},
    ):
        Attempt(_assignment(**fields), settings).start()
    adaptive, fixed, off = (c[: c.index("--")] for c in commands)
    assert adaptive[adaptive.index("--hang-timeout-s") + 1] == "600.0"
    assert "--hang-timeout-adaptive" in adaptive
    assert fixed[fixed.index("--hang-timeout-s") + 1] == "45.0"
    assert "--hang-timeout-adaptive" not in fixed
    assert "--hang-timeout-s" not in off and "--hang-timeout-adaptive" not in off


def test_workers_get_the_collective_timeout_and_nccl_error_handling(tmp_path: Path) -> None:
    settings = AgentSettings(enrolment_token="t", controller_url="http://c:1", work_dir=tmp_path)
    env = build_launcher_env(
        _assignment(collective_timeout_s=120.0),
        settings=settings,
        events_file=tmp_path / "e",
        base_env={},
    )
    assert env["RELAUNCH_COLLECTIVE_TIMEOUT_S"] == "120"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    own = build_launcher_env(
        _assignment(env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}),
        settings=settings,
        events_file=tmp_path / "e",
        base_env={},
    )
    assert own["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # the job's choice stands
    assert "RELAUNCH_COLLECTIVE_TIMEOUT_S" not in own  # none sent: the Trainer's default


def test_a_missing_working_dir_fails_the_attempt_as_fatal_without_a_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def popen(*args: object, **kwargs: object) -> None:
        raise AssertionError("no launcher may start")

    monkeypatch.setattr(attempt_module.subprocess, "Popen", popen)
    missing = tmp_path / "nope"
    attempt = Attempt(_assignment(working_dir=str(missing)), _settings(tmp_path))
    attempt.start()
    assert attempt.exit is not None
    assert (attempt.exit.outcome, attempt.exit.fatal) == ("failed", True)
    assert attempt.exit.message == f"working_dir {missing} does not exist on node node-a"

    a_file = tmp_path / "file"
    a_file.write_text("")
    attempt = Attempt(_assignment(working_dir=str(a_file)), _settings(tmp_path))
    attempt.start()
    assert attempt.exit is not None and attempt.exit.fatal
    assert attempt.exit.message == f"working_dir {a_file} is not a directory on node node-a"


def test_a_private_file_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "node-token"
    path.write_text("old")
    path.chmod(0o644)
    write_private(path, "rln_secret")
    assert path.read_text() == "rln_secret"
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_spare_zygote_loads_with_what_a_one_process_cpu_attempt_gets_here(
    tmp_path: Path,
) -> None:
    # The spare is loaded before any job, so it must be loaded with every variable that the
    # agent sets alike for each attempt on this node; otherwise no job could adopt it.
    from worker.attempt import spare_env
    from worker.warm import spare_refusal

    settings = _settings(tmp_path)
    agent_env = {"PATH": "/bin", "HOME": "/root", "RELAUNCH_AGENT_ENROLMENT_TOKEN": "secret"}
    spare = spare_env(settings, agent_env)
    assert "RELAUNCH_AGENT_ENROLMENT_TOKEN" not in spare
    for job_env, usable in (
        ({"FOO": "bar", "WANDB_PROJECT": "x"}, True),
        ({"PYTHONHASHSEED": "0"}, False),  # read as the interpreter starts
        ({"TORCH_LOGS": "+dynamo"}, False),  # read as torch is imported
        ({"OMP_NUM_THREADS": "1"}, settings.cpus == 1),  # numpy's pool took the spare's
    ):
        launcher = build_launcher_env(
            _assignment(nproc_per_node=1, env=job_env),
            settings=settings,
            events_file=tmp_path / "e",
            base_env=agent_env,
        )
        reason = spare_refusal(launcher, spare)
        assert (reason is None) == usable, (job_env, reason)
    # Two processes per node share the cores: their thread count is not the spare's.
    two = build_launcher_env(
        _assignment(nproc_per_node=2, env={}),
        settings=settings,
        events_file=tmp_path / "e",
        base_env=agent_env,
    )
    assert settings.cpus == 1 or "OMP_NUM_THREADS" in (spare_refusal(two, spare) or "")
