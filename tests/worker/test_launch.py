"""worker.launch on its own: torch's elastic agent in-process, events as data."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from contract.protocol import RENDEZVOUS_CLOSED_EXIT

REPO = Path(__file__).resolve().parents[2]

_FLAKY_WORKER = textwrap.dedent(
    """
    import os, sys
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    local_rank = int(os.environ["LOCAL_RANK"])
    print(f"rank {local_rank} incarnation {restart}", flush=True)
    if local_rank == 1 and restart == 0:
        sys.exit(3)
    """
)

_QUICK_WORKER = "print('done', flush=True)\n"

_FAILING_WORKER = textwrap.dedent(
    """
    import os
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main() -> None:
        if os.environ["LOCAL_RANK"] == "0":
            raise RuntimeError("bad batch")

    main()
    """
)


def _launch(
    tmp_path: Path,
    script: str,
    max_restarts: int,
    rendezvous: list[str] | None = None,
    nproc: int = 2,
    *,
    extra_env: dict[str, str] | None = None,
    bootstrap: bool = False,
) -> tuple[int, list[dict[str, Any]]]:
    """Run one launcher to its end: its exit code and its events. ``rendezvous``: torchrun's
    rendezvous arguments (default ``--standalone``); ``bootstrap``: each worker starts in
    ``worker.bootstrap``, as the node agent starts them."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    program = tmp_path / "train.py"
    program.write_text(script)
    events = tmp_path / "events.jsonl"
    argv = [
        sys.executable, "-m", "worker.launch", "--events-file", str(events),
        "--parent-pid", str(os.getpid()), "--",
        *(rendezvous or ["--standalone"]), "--nproc-per-node", str(nproc),
        "--max-restarts", str(max_restarts), "--monitor-interval", "0.2",
        "--tee", "3", "--log-dir", str(tmp_path / "logs"),
        *(["-m", "worker.bootstrap"] if bootstrap else []), str(program),
    ]  # fmt: skip
    run = subprocess.run(
        argv,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(extra_env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = events.read_text().splitlines() if events.exists() else []
    assert run.stdout or run.stderr
    return run.returncode, [json.loads(line) for line in lines]


def _of(kind: str, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["data"] for e in events if e["kind"] == kind]


def test_a_worker_failure_is_restarted_and_recorded(tmp_path: Path) -> None:
    code, events = _launch(tmp_path, _FLAKY_WORKER, max_restarts=1)
    assert code == 0
    rounds = _of("rendezvous", events)
    assert [r["restart_count"] for r in rounds] == [0, 1]
    assert all(r["world_size"] == 2 and r["group_world_size"] == 1 for r in rounds)
    failed = _of("worker_failed", events)
    assert {"local_rank": 1, "global_rank": 1, "exitcode": 3} in [
        {k: f[k] for k in ("local_rank", "global_rank", "exitcode")} for f in failed
    ]
    assert _of("launcher_exit", events) == [
        {"outcome": "succeeded", "exitcode": 0, "message": "", "fatal": False}
    ]
    assert events[-1]["kind"] == "launcher_exit"


def test_a_failure_without_restarts_left_fails_the_launcher(tmp_path: Path) -> None:
    code, events = _launch(tmp_path, _FAILING_WORKER, max_restarts=0)
    assert code != 0
    assert len(_of("rendezvous", events)) == 1
    failed = [f for f in _of("worker_failed", events) if f["local_rank"] == 0]
    assert failed and failed[0]["exitcode"] == 1
    assert failed[0]["message"] == "RuntimeError: bad batch"
    (exit_event,) = _of("launcher_exit", events)
    assert exit_event["outcome"] == "failed"
    assert exit_event["exitcode"] == code
    assert "RuntimeError: bad batch" in exit_event["message"]


def test_bad_torchrun_arguments_still_end_with_a_launcher_exit(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "worker.launch", "--events-file", str(events), "--",
         "--no-such-flag"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert run.returncode == 2
    (line,) = events.read_text().splitlines()
    assert json.loads(line)["data"]["outcome"] == "failed"


def test_a_long_worker_error_still_fits_in_one_event_line(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from contract.events import WorkerFailed, parse_event
    from worker.launch import MAX_MESSAGE_CHARS, failure_message
    from worker.runtime.events import EventWriter

    traceback = "Traceback (most recent call last):\n" + "  frame\n" * 5000
    failure = SimpleNamespace(
        message={"message": traceback}, error_file="/tmp/err.json", exitcode=1
    )
    message = failure_message(failure)
    assert len(message) == MAX_MESSAGE_CHARS
    assert message.startswith("Traceback") and message.endswith("...")
    path = tmp_path / "events.jsonl"
    with EventWriter(path) as events:
        events.emit(WorkerFailed(local_rank=0, global_rank=0, exitcode=1, message=message))
    [line] = path.read_text().splitlines()
    event = parse_event(line)
    assert isinstance(event.data, WorkerFailed) and event.data.message == message


def test_a_launcher_that_comes_after_the_rendezvous_closed_says_so(tmp_path: Path) -> None:
    """A node that joins just as a job finishes finds its rendezvous closed (the first
    launcher closed it by ending): that ends with its own exit code and outcome, which the
    agent reports as ``closed`` and the controller does not charge."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    rendezvous = [
        "--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-id", "closing",
        "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-conf", "last_call_timeout=1",
    ]  # fmt: skip
    first, first_events = _launch(tmp_path / "first", _QUICK_WORKER, 0, rendezvous, nproc=1)
    assert first == 0
    assert _of("launcher_exit", first_events)[0]["outcome"] == "succeeded"
    late, late_events = _launch(tmp_path / "late", _QUICK_WORKER, 3, rendezvous, nproc=1)
    assert late == RENDEZVOUS_CLOSED_EXIT
    assert _of("rendezvous", late_events) == []
    (exit_event,) = _of("launcher_exit", late_events)
    assert (exit_event["outcome"], exit_event["exitcode"]) == ("closed", RENDEZVOUS_CLOSED_EXIT)


def test_a_cuda_attempt_with_too_few_gpus_fails_at_once_without_restarts(
    tmp_path: Path,
) -> None:
    """Two local ranks placed for CUDA, no GPU visible to them (none here; hidden on a
    GPU host): a start-up error, fatal, and the restarts left are not spent."""
    cuda = {"RELAUNCH_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": ""}
    started = "from pathlib import Path\nPath(__file__).with_name('started').touch()\n"
    code, events = _launch(tmp_path, started, max_restarts=3, extra_env=cuda, bootstrap=True)
    assert code != 0
    assert not (tmp_path / "started").exists(), "the program ran"
    assert len(_of("rendezvous", events)) == 1, "a restart was spent"
    failed = _of("worker_failed", events)
    assert failed and all(f["cause"] == "startup_error" and f["fatal"] for f in failed)
    assert "DeviceShortage" in failed[0]["message"]
    assert "2 local rank(s) need one each" in failed[0]["message"]
    (exit_event,) = _of("launcher_exit", events)
    assert exit_event["outcome"] == "failed" and exit_event["fatal"]
    assert "startup error" in exit_event["message"]


def test_the_launcher_ends_without_waiting_for_threads_left_running(tmp_path: Path) -> None:
    # A thread that never ends (as torch's log tail of an interrupted start can be) must not
    # keep a launcher alive once its main has returned or raised; what it printed arrives.
    cases = {
        "return 7": (7, "written before the end"),
        "raise RuntimeError('boom')": (1, "RuntimeError: boom"),
        "raise SystemExit(3)": (3, ""),
    }
    for body, (status, said) in cases.items():
        code = textwrap.dedent(
            f"""
            import threading, sys
            from worker.ending import run_then_exit
            threading.Thread(target=threading.Event().wait, name="never-ends").start()
            def main():
                sys.stdout.write("written before the end")  # no newline: still buffered
                {body}
            run_then_exit(main)
            """
        )
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == status, (body, done.stderr)
        assert done.stdout == "written before the end"
        assert said in done.stderr + done.stdout
        assert "exiting without waiting for threads: never-ends" in done.stderr


_ABORTS_IN_TEARDOWN = """\
import os, sys, time
FLAG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank0-ending")

class Ending:
    # Freed in the interpreter's teardown, after the exit handlers: rank 1 aborts there
    # (as torch's gloo can), once rank 0 is in its own teardown, still alive for torch
    # to end with SIGTERM. Only what the defaults bind is used: modules are being cleared.
    def __init__(self, rank):
        self.rank = rank

    def __del__(self, flag=FLAG, abort=os.abort, sleep=time.sleep, stat=os.stat,
                os_open=os.open, close=os.close, create=os.O_CREAT | os.O_WRONLY):
        if self.rank == "0":
            close(os_open(flag, create))
            sleep(60)
        for _ in range(600):
            try:
                stat(flag)
                break
            except OSError:
                sleep(0.05)
        abort()

sys.keep_until_teardown = Ending(os.environ["RANK"])
if os.environ["RANK"] == "0" and "{where}" == "program":
    open(FLAG, "w").close()
    time.sleep(60)  # still in the program
"""


@pytest.mark.parametrize("where", ["teardown", "program"])
def test_a_worker_aborted_after_its_program_returned_has_finished(
    tmp_path: Path, where: str
) -> None:
    """Rank 1's program returns, then its teardown aborts (SIGABRT); torch then ends rank
    0 with SIGTERM. If rank 0 too had returned, the group has finished: no failure, no
    restart. If rank 0 was still in its program, it is a failure as before."""
    code, events = _launch(
        tmp_path, _ABORTS_IN_TEARDOWN.format(where=where), max_restarts=1, bootstrap=True
    )
    if where == "teardown":
        assert code == 0
        assert not _of("worker_failed", events)
        assert len(_of("rendezvous", events)) == 1, "restarted"
        (exit_event,) = _of("launcher_exit", events)
        assert exit_event["outcome"] == "succeeded"
    else:
        assert code != 0
        failed = _of("worker_failed", events)
        assert {f["global_rank"] for f in failed} >= {1}
        assert len(_of("rendezvous", events)) == 2, "the failure was not restarted"
