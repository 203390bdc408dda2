"""The launcher's own decisions: failure causes, fatal errors, hangs; and the bootstrap."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from contract.events import EventKind
from contract.protocol import RestartPolicy
from worker.hang import FLOOR_S, HangRule, HangTimeout
from worker.launch import Supervision
from worker.runtime.events import EventWriter
from worker.runtime.progress import progress_file

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Failure:
    """The parts of torch's ProcessFailure that the launcher reads."""

    local_rank: int
    pid: int
    exitcode: int
    message: Any
    error_file: str = "/tmp/error.json"
    timestamp: int = 0


@dataclass
class Worker:
    local_rank: int
    global_rank: int
    id: int


def _raised(message: str) -> Failure:
    """A worker that exited 1 after ``@record`` wrote ``message`` to its error file."""
    return Failure(0, 10, 1, {"message": message})


def _supervision(tmp_path: Path, **kwargs: Any) -> tuple[Supervision, Path]:
    events = tmp_path / "events.jsonl"
    return Supervision(events=EventWriter(events), **kwargs), events


def _emitted(path: Path) -> list[dict[str, Any]]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize(
    ("failure", "cause", "fatal"),
    [
        (_raised("RuntimeError: loss is nan"), "crash", False),
        (Failure(0, 10, 42, "<N/A>", error_file="<N/A>"), "fatal_exit_code", True),
        (_raised("ModuleNotFoundError: No module named 'x'"), "startup_error", True),
        (_raised("SyntaxError: invalid syntax (t.py, line 1)"), "startup_error", True),
        (_raised("EntrypointNotFound: script '/a.py' does not exist"), "startup_error", True),
        (Failure(0, 10, -9, "<N/A>", error_file="<N/A>"), "crash", False),
        (_raised("RuntimeError: [gloo/pair.cc:537] Read error: Connection reset by peer."),
         "peer_lost", False),
    ],
)  # fmt: skip
def test_failures_are_classified(tmp_path: Path, failure: Failure, cause: str, fatal: bool) -> None:
    supervision, _ = _supervision(tmp_path, policy=RestartPolicy(fatal_exit_codes=[42]))
    assert supervision.classify(failure) == (cause, fatal)


_NCCL = "DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356, "
_TIMED_OUT = (
    "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
    "OpType=ALLREDUCE, NumelIn=4, NumelOut=4, Timeout(ms)=30000) ran for 30012 milliseconds "
    "before timing out."
)


@pytest.mark.parametrize(
    ("failure", "cause", "fatal"),
    [
        (_raised(_NCCL + "remote process exited or there was a network error, NCCL version "
                 "2.27.5\nncclRemoteError: A call failed possibly due to a network error or a "
                 "remote process exiting prematurely."), "peer_lost", False),
        (_raised("DistBackendError: NCCL communicator was aborted on rank 1. Original reason "
                 "for failure was: NCCL error: remote process exited or there was a network "
                 "error"), "peer_lost", False),
        (_raised("DistBackendError: NCCL communicator was aborted on rank 1. Original reason "
                 f"for failure was: {_TIMED_OUT}"), "crash", False),
        (_raised(f"DistBackendError: {_TIMED_OUT}"), "crash", False),
        (_raised(_NCCL + "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL "
                 "version 2.27.5\nncclSystemError: System call (e.g. socket, malloc) or "
                 "external library call failed or device error."), "crash", False),
        (_raised("DistBackendError: NCCL communicator was aborted on rank 0. Original reason "
                 "for failure was: NCCL error: unhandled system error (run with NCCL_DEBUG=INFO "
                 "for details)"), "crash", False),
        (Failure(0, 10, -6, "Signal 6 (SIGABRT) received by PID 10", error_file="<N/A>"),
         "crash", False),
        (_raised("DeviceShortage: 1 CUDA device(s) visible (CUDA_VISIBLE_DEVICES='3') but 2 "
                 "local rank(s) need one each"), "startup_error", True),
        (_raised("AcceleratorError: CUDA error: invalid device ordinal\nCUDA kernel errors "
                 "might be asynchronously reported"), "startup_error", True),
        (_raised("RuntimeError: No CUDA GPUs are available"), "startup_error", True),
        (_raised(_NCCL + "invalid usage (run with NCCL_DEBUG=WARN for details)\n"
                 "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
                 "Last error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device "
                 "1b000"), "startup_error", True),
    ],
    ids=["nccl-remote-error", "nccl-aborted-for-a-lost-peer", "nccl-aborted-for-a-timeout",
         "nccl-timeout", "nccl-system-error", "nccl-aborted-for-a-system-error",
         "nccl-watchdog-abort", "device-shortage",
         "invalid-device-ordinal", "no-gpu", "duplicate-gpu"],
)  # fmt: skip
def test_nccl_and_cuda_failures_are_classified(
    tmp_path: Path, failure: Failure, cause: str, fatal: bool
) -> None:
    """A lost peer is free, a timeout or a local NCCL error is a crash, a rank without a
    GPU of its own cannot start."""
    supervision, _ = _supervision(tmp_path)
    assert supervision.classify(failure) == (cause, fatal)


# NCCL's message for a communicator aborted for a timeout, with the C++ frames torch
# puts before the reason: the reason comes past the event's cut (MAX_MESSAGE_CHARS).
_FRAMES = "".join(
    f"frame #{i}: c10d::ProcessGroupNCCL::Watchdog::run() + 0x{i:x}\n" for i in range(40)
)
_ABORTED_LATE = (
    f"DistBackendError: NCCL communicator was aborted on rank 1.\n{_FRAMES}"
    f"Original reason for failure was: {_TIMED_OUT}"
)


@pytest.mark.parametrize(
    ("message", "cause"),
    [
        ("BrokenPipeError: [Errno 32] Broken pipe", "crash"),
        ("ConnectionResetError: [Errno 104] Connection reset by peer", "crash"),
        ("OSError: [Errno 104] Connection reset by peer", "crash"),
        ("DistNetworkError: [gloo/pair.cc:537] Read error: Connection reset by peer", "peer_lost"),
        ("DistError: Connection closed by peer", "peer_lost"),
        (_ABORTED_LATE, "crash"),
        (_ABORTED_LATE.replace(_TIMED_OUT, "NCCL error: remote process exited or there was "
                               "a network error"), "peer_lost"),
    ],
    ids=["broken-pipe", "connection-reset", "os-error", "dist-network-error", "dist-error",
         "timeout-past-the-cut", "lost-peer-past-the-cut"],
)  # fmt: skip
def test_only_torchs_collective_errors_read_whole_can_lose_a_peer(
    tmp_path: Path, message: str, cause: str
) -> None:
    """A script's own socket errors cost a restart (a deterministic bug must not restart
    for free forever); the reason of an aborted communicator counts wherever it comes."""
    supervision, _ = _supervision(tmp_path)
    assert supervision.classify(_raised(message)) == (cause, False)


def test_a_fatal_failure_is_recorded_with_its_reason(tmp_path: Path) -> None:
    supervision, path = _supervision(tmp_path)
    failures = {
        1: Failure(1, 11, -15, "<N/A>", error_file="<N/A>", timestamp=2),
        0: Failure(0, 10, 1, {"message": "ImportError: cannot import name 'y'"}, timestamp=1),
    }
    assert supervision.on_failed(failures) is True
    assert supervision.fatal is not None and "startup error on rank 0" in supervision.fatal
    supervision.events.close()
    emitted = [e["data"] for e in _emitted(path) if e["kind"] == EventKind.WORKER_FAILED]
    assert [(e["global_rank"], e["cause"], e["fatal"]) for e in emitted] == [
        (0, "startup_error", True),  # the first by time comes first
        (1, "crash", False),
    ]


def test_a_worker_that_stops_beating_is_dumped_then_killed(tmp_path: Path) -> None:
    progress = tmp_path / "progress"
    progress.mkdir()
    hung = subprocess.Popen(
        [sys.executable, "-c", "import faulthandler, signal, time\n"
         "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
         "print('ready', flush=True)\ntime.sleep(60)\n"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert hung.stdout is not None and hung.stdout.readline() == "ready\n"
    busy = Worker(local_rank=1, global_rank=3, id=os.getpid())  # must not be signalled
    stuck = Worker(local_rank=0, global_rank=2, id=hung.pid)
    clock = [1000.0]
    supervision, path = _supervision(
        tmp_path, hang_rule=HangRule(5), progress_dir=progress, clock=lambda: clock[0]
    )
    assert supervision.find_hung([stuck, busy]) == []  # neither has beaten yet
    for worker, at in ((stuck, 996.0), (busy, 999.0)):
        progress_file(progress, worker.local_rank).touch()
        os.utime(progress_file(progress, worker.local_rank), (at, at))
    assert supervision.find_hung([stuck, busy]) == []  # 4 s idle is not yet a hang
    clock[0] = 1001.5
    found = supervision.find_hung([stuck, busy])
    assert [w for w, _, _ in found] == [stuck]

    supervision.end_hung([stuck], found)
    _, stderr = hung.communicate(timeout=10)
    assert hung.returncode == -9
    assert "most recent call first" in stderr  # faulthandler's dump
    assert hung.pid in supervision.hung_pids
    failure = Failure(0, hung.pid, -9, "<N/A>", error_file="<N/A>")
    assert supervision.classify(failure) == ("hang", False)
    supervision.events.close()
    (hang,) = [e["data"] for e in _emitted(path) if e["kind"] == EventKind.HANG]
    assert hang["global_rank"] == 2 and hang["idle_s"] == 5.5
    assert (hang["timeout_s"], hang["rule"]) == (5, "fixed")


def test_the_default_timeout_follows_the_beats_the_launcher_sees(tmp_path: Path) -> None:
    """Sub-second steps: hung after the floor, not the cap; a restart starts over."""
    progress = tmp_path / "progress"
    progress.mkdir()
    beats = progress_file(progress, 0)
    worker = Worker(local_rank=0, global_rank=0, id=4242)
    clock = [1000.0]
    supervision, _ = _supervision(
        tmp_path,
        hang_rule=HangRule(600, adaptive=True),
        progress_dir=progress,
        clock=lambda: clock[0],
    )

    def beat_and_pass(at: float) -> list[Any]:
        beats.touch()
        os.utime(beats, (at, at))
        clock[0] = at + 0.1
        return supervision.find_hung([worker])

    for i in range(3):  # too few beats to know the rhythm: the cap holds
        assert beat_and_pass(1000.0 + i * 0.3) == []
    clock[0] = 1000.6 + FLOOR_S + 1
    assert supervision.find_hung([worker]) == []
    for i in range(3, 20):
        assert beat_and_pass(1000.0 + i * 0.3) == []
    last = 1000.0 + 19 * 0.3
    clock[0] = last + FLOOR_S - 1
    assert supervision.find_hung([worker]) == []
    clock[0] = last + FLOOR_S + 1
    [(found, idle, timeout)] = supervision.find_hung([worker])
    assert found is worker and idle > FLOOR_S
    assert (timeout.seconds, timeout.rule) == (FLOOR_S, "adaptive")

    supervision.clear_progress([0])  # a new rendezvous round: the beats start over
    assert not beats.exists()
    assert beat_and_pass(2000.0) == []
    clock[0] = 2000.0 + FLOOR_S + 1
    assert supervision.find_hung([worker]) == []  # one beat again: the cap holds

    gone = Worker(local_rank=0, global_rank=0, id=None)  # nothing to signal
    supervision.end_hung([gone], [(gone, idle, timeout)])
    assert supervision.beats is not None and supervision.beats.rule.floor_s == 2 * FLOOR_S


def test_hung_workers_ended_after_the_peers_finished_are_a_finish_only_alone(
    tmp_path: Path,
) -> None:
    supervision, path = _supervision(tmp_path, hang_rule=HangRule(5), progress_dir=tmp_path)
    stuck = Worker(local_rank=0, global_rank=1, id=None)  # nothing to signal
    timeout = HangTimeout(5, "fixed", "5 s")
    supervision.end_hung([stuck], [(stuck, 6.0, timeout)], peers_finished=True)
    supervision.hung_pids.add(4242)  # as end_hung records a worker it killed
    ended = Failure(0, 4242, -9, "<N/A>", error_file="<N/A>")
    crashed = Failure(1, 4343, 1, "<N/A>", error_file="<N/A>")
    # Another failure beside the hung one is a failure, and the flag is spent either way.
    assert supervision.finished_after_peers({1: ended, 2: crashed}) is False
    assert supervision.finished_after_peers({1: ended}) is False
    supervision.end_hung([stuck], [(stuck, 6.0, timeout)], peers_finished=True)
    assert supervision.finished_after_peers({1: ended}) is True
    assert supervision.hung_pids == set()
    supervision.end_hung([stuck], [(stuck, 6.0, timeout)])  # peers still running
    supervision.hung_pids.add(4242)
    assert supervision.finished_after_peers({1: ended}) is False
    supervision.events.close()
    hangs = [e["data"] for e in _emitted(path) if e["kind"] == EventKind.HANG]
    assert [h["peers_finished"] for h in hangs] == [True, True, False]


@dataclass
class Agent:
    """The parts of torch's elastic agent that the peers' checks read: the round's store."""

    _store: Any


def test_a_node_whose_workers_all_began_their_teardown_counts_as_finished_for_its_peers(
    tmp_path: Path,
) -> None:
    """A node whose workers are all in their teardown has finished its training before its
    agent enters torch's exit barrier (a gloo teardown can wait for the hung peer), so the
    hung worker of another node is ended as finished; its own count does not count for
    itself, and a node that takes its teardown back (a process group initialised again)
    takes its count back."""
    from torch.distributed import HashStore

    from worker.launch import TEARDOWN_NODES_KEY, _peers_finished, announce_teardown

    round_store = HashStore()
    here, there = Agent(round_store), Agent(round_store)
    hung_node, _ = _supervision(tmp_path)
    other_node, _ = _supervision(tmp_path)
    assert _peers_finished(here, hung_node) is False
    announce_teardown(there, other_node, True)
    announce_teardown(there, other_node, True)  # counted once, however often it is seen
    assert _peers_finished(here, hung_node) is True
    announce_teardown(here, hung_node, True)
    assert _peers_finished(there, other_node) is True  # the hung node's own count is not
    announce_teardown(there, other_node, False)
    assert _peers_finished(here, hung_node) is False
    assert round_store.add(TEARDOWN_NODES_KEY, 0) == 1
    # A node in torch's exit barrier has finished too, whatever the count says.
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils.store import _NUM_MEMBERS

    round_store.add(_TERMINAL_STATE_SYNC_ID + _NUM_MEMBERS, 1)
    assert _peers_finished(here, hung_node) is True


def test_a_store_that_cannot_be_told_leaves_the_node_uncounted(tmp_path: Path) -> None:
    class Gone:
        def add(self, key: str, amount: int) -> int:
            raise RuntimeError("the round's store is gone")

    from worker.launch import _peers_finished, announce_teardown

    supervision, _ = _supervision(tmp_path)
    announce_teardown(Agent(Gone()), supervision, True)
    assert supervision.teardown_announced is False
    assert _peers_finished(Agent(Gone()), supervision) is False


def test_restart_back_off_doubles_up_to_the_cap() -> None:
    policy = RestartPolicy(backoff_s=1.5, backoff_max_s=5)
    assert [policy.delay_s(n) for n in range(1, 6)] == [0, 1.5, 3, 5, 5]
    assert RestartPolicy(backoff_s=0).delay_s(4) == 0


def _bootstrap(
    tmp_path: Path, *args: str, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    error_file = tmp_path / "error.json"
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file), "PYTHONPATH": str(REPO)}
    env.update(extra_env or {})
    return subprocess.run(
        [sys.executable, "-m", "worker.bootstrap", *args],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_the_bootstrap_runs_a_script_as_python_would(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "helper.py").write_text("VALUE = 'from beside the script'\n")
    script = tmp_path / "sub" / "main.py"
    script.write_text(
        "import sys, helper\n"
        "if __name__ == '__main__':\n"
        "    print(sys.argv, helper.VALUE, __file__)\n"
        "    sys.exit(7)\n"
    )
    run = _bootstrap(tmp_path, str(script), "--lr", "0.1")
    assert run.returncode == 7, run.stderr
    assert f"[{str(script)!r}, '--lr', '0.1'] from beside the script {script}" in run.stdout


def test_the_bootstrap_records_a_startup_error(tmp_path: Path) -> None:
    run = _bootstrap(tmp_path, "-m", "no_such_package_here")
    assert run.returncode == 1
    text = (tmp_path / "error.json").read_text()
    assert "EntrypointNotFound" in text and "no_such_package_here" in text


_LOSES_A_PEER = textwrap.dedent(
    """
    import atexit, sys
    from pathlib import Path
    here = Path(__file__).parent

    class Finalized:
        def __del__(self):
            (here / "finalized").write_text("yes")

    KEPT = Finalized()  # finalized only by the interpreter's own end
    atexit.register(lambda: (here / "atexit").write_text("yes"))
    print("buffered", end="")
    raise RuntimeError(sys.argv[1])
    """
)


@pytest.mark.parametrize(
    ("message", "quick"),
    [("[pair.cc:553] Connection closed by peer [127.0.0.1]:16514", True), ("bad batch", False)],
    ids=["peer-lost", "other-error"],
)
def test_a_worker_whose_collective_lost_its_peer_exits_without_the_last_collection(
    tmp_path: Path, message: str, quick: bool
) -> None:
    script = tmp_path / "train.py"
    script.write_text(_LOSES_A_PEER)
    run = _bootstrap(tmp_path, str(script), message)
    assert run.returncode == 1
    assert run.stdout == "buffered"  # flushed either way
    assert f"RuntimeError: {message}" in run.stderr  # the traceback, as Python prints it
    assert "RuntimeError" in (tmp_path / "error.json").read_text()
    assert (tmp_path / "atexit").exists()
    # Only an ordinary end runs the last garbage collection, and with it __del__.
    assert (tmp_path / "finalized").exists() is not quick


_MARKS_ITS_START = "from pathlib import Path\nPath(__file__).with_name('started').touch()\n"


def test_the_bootstrap_refuses_to_start_a_cuda_worker_without_a_gpu_of_its_own(
    tmp_path: Path,
) -> None:
    """Two local ranks, no GPU visible (none here; hidden on a GPU host)."""
    script = tmp_path / "train.py"
    script.write_text(_MARKS_ITS_START)
    cuda = {"RELAUNCH_DEVICE": "cuda", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": ""}
    run = _bootstrap(tmp_path, str(script), extra_env=cuda)
    assert run.returncode == 1
    assert not (tmp_path / "started").exists()
    text = (tmp_path / "error.json").read_text()
    assert "DeviceShortage" in text and "2 local rank(s) need one each" in text


def test_the_bootstrap_starts_a_cpu_worker_without_counting_gpus(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_MARKS_ITS_START)
    cpu = {"RELAUNCH_DEVICE": "cpu", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": ""}
    run = _bootstrap(tmp_path, str(script), extra_env=cpu)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "started").exists()


@pytest.mark.parametrize(
    ("message", "lost"),
    [
        ("NCCL error in: ProcessGroupNCCL.cpp:1, remote process exited or there was a "
         "network error, NCCL version 2.27.5", True),
        ("NCCL communicator was aborted on rank 0. Original reason for failure was: "
         "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3)", False),
    ],
)  # fmt: skip
def test_a_collective_that_timed_out_did_not_lose_its_peer(message: str, lost: bool) -> None:
    """The bootstrap's quick end and the launcher's free restart read the same rule."""
    from worker.bootstrap import peer_lost

    assert peer_lost(RuntimeError(message)) is lost


class _OwnError(RuntimeError):
    """A script's own exception, a RuntimeError but none of torch's collectives'."""


@pytest.mark.parametrize(
    ("exc", "lost"),
    [
        (RuntimeError("[gloo/pair.cc:537] Read error: Connection reset by peer"), True),
        (ConnectionResetError(104, "Connection reset by peer"), False),
        (BrokenPipeError(32, "Broken pipe"), False),
        (_OwnError("upload failed: Connection reset by peer"), False),
    ],
    ids=["gloo", "connection-reset", "broken-pipe", "own-runtime-error"],
)
def test_the_bootstrap_ends_quickly_only_for_torchs_collective_errors(
    exc: BaseException, lost: bool
) -> None:
    from worker.bootstrap import peer_lost

    assert peer_lost(exc) is lost


# An object freed in the interpreter's teardown, after the atexit handlers, that aborts
# the process then: as torch's gloo can at exit.
ABORTS_IN_TEARDOWN = (
    "class AbortsWhenFreed:\n"
    "    def __del__(self, abort=os.abort):\n"
    "        abort()\n"
    "sys.keep_until_teardown = AbortsWhenFreed()\n"
)
_THREAD_ABORTS_LATER = (
    "import threading, time\n"
    "threading.Thread(target=lambda: (time.sleep(0.3), os.abort())).start()\n"
)
_CHILD_EXITS_0 = "pid = os.fork()\nif pid == 0:\n    sys.exit(0)\nos.waitpid(pid, 0)\nos.abort()\n"


@pytest.mark.parametrize(
    ("ending", "code", "marked"),
    [
        ("pass", 0, True),
        ("sys.exit(0)", 0, True),
        ("sys.exit()", 0, True),
        (ABORTS_IN_TEARDOWN, -6, True),
        ("atexit.register(os.abort)", -6, False),  # the program's own exit handler
        (_THREAD_ABORTS_LATER, -6, False),  # a thread of the program, still at work
        (_CHILD_EXITS_0, -6, False),  # a child it forked returned; it did not
        ("sys.exit(3)", 3, False),
        ("raise ValueError('bad')", 1, False),
        ("os.abort()", -6, False),
    ],
    ids=[
        "return", "exit-0", "exit", "teardown-abort", "atexit-abort", "thread-abort",
        "forked-child", "exit-3", "raise", "abort",
    ],
)  # fmt: skip
def test_the_bootstrap_marks_that_the_program_returned_before_the_teardown(
    tmp_path: Path, ending: str, code: int, marked: bool
) -> None:
    """Only the worker's own process, only once its threads and exit handlers are done."""
    script = tmp_path / "train.py"
    script.write_text(f"import atexit, os, sys\n{ending}\n")
    env = {
        **os.environ,
        "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json"),
        "PYTHONPATH": str(REPO),
    }
    with subprocess.Popen(
        [sys.executable, "-m", "worker.bootstrap", str(script)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as worker:
        _, stderr = worker.communicate(timeout=120)
    assert worker.returncode == code, stderr
    marks = sorted(p.name for p in tmp_path.glob("program_returned*"))
    assert marks == ([f"program_returned.{worker.pid}"] if marked else []), marks


@dataclass
class _Failure:
    local_rank: int
    pid: int
    exitcode: int


def test_a_signal_after_the_mark_is_a_finish_whichever_directory_holds_it(
    tmp_path: Path,
) -> None:
    """The mark lies beside torch's error file, or under isolation 'user' in the job's own
    directory beside it; it must name the failed process."""
    from types import SimpleNamespace

    from worker.launch import returned_before_signals

    ranks = [tmp_path / "attempt_0" / str(r) for r in (0, 1)]
    for rank in ranks:
        (rank / "worker").mkdir(parents=True)
    agent = SimpleNamespace(
        _pcontext=SimpleNamespace(error_files={r: str(ranks[r] / "error.json") for r in (0, 1)})
    )
    aborted, ended = _Failure(1, 701, -6), _Failure(0, 700, -15)
    failures = {1: aborted, 0: ended}
    (ranks[1] / "program_returned.701").touch()  # isolation 'none': beside torch's file
    assert not returned_before_signals(agent, failures)  # rank 0 had not returned
    (ranks[0] / "worker" / "program_returned.700").touch()  # isolation 'user'
    assert returned_before_signals(agent, failures)
    assert not returned_before_signals(agent, {1: _Failure(1, 701, 3)})  # a status of its own
    assert not returned_before_signals(agent, {1: _Failure(1, 702, -6)})  # another process
    assert not returned_before_signals(SimpleNamespace(), failures)  # no process context


_TEARDOWN_SCRIPT = """\
import os, sys
import torch.distributed as dist
from torch.distributed import destroy_process_group  # bound after the bootstrap wrapped it

mark = os.path.join(os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"]),
                    f"teardown_started.{os.getpid()}")
store = "file://" + os.path.join(os.getcwd(), "store")
dist.init_process_group("gloo", init_method=store + "1", rank=0, world_size=1)
seen = [os.path.exists(mark)]
group = dist.new_group([0])
dist.destroy_process_group(group)  # a group of its own: still training
seen.append(os.path.exists(mark))
destroy_process_group()
seen.append(os.path.exists(mark))
dist.init_process_group("gloo", init_method=store + "2", rank=0, world_size=1)
seen.append(os.path.exists(mark))  # training again
dist.destroy_process_group()
seen.append(os.path.exists(mark))
print("seen", seen)
"""


def test_the_bootstrap_marks_the_teardown_when_the_default_group_is_destroyed(
    tmp_path: Path,
) -> None:
    """Through either name of the function; not for a group of its own; and the mark is
    taken back when the program initialises a default group again."""
    script = tmp_path / "train.py"
    script.write_text(_TEARDOWN_SCRIPT)
    done = _bootstrap(tmp_path, str(script))
    assert done.returncode == 0, done.stderr
    assert "seen [False, False, True, False, True]" in done.stdout, done.stdout


def _sleeper(code: str = "time.sleep(60)") -> subprocess.Popen[str]:
    """A worker stand-in that dumps its stacks on SIGUSR1, as the bootstrap's workers do."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import faulthandler, signal, time\n"
         "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
         f"print('ready', flush=True)\n{code}\n"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_a_teardown_that_uses_no_cpu_is_ended_as_finished_and_one_at_work_is_not(
    tmp_path: Path,
) -> None:
    """The hang rule does not judge a worker in its teardown; its CPU does. A worker
    stuck there is dumped and killed, and its failure is the group's finish."""
    from types import SimpleNamespace

    from worker.hang import TEARDOWN_IDLE_S
    from worker.launch import in_teardown

    ranks = [tmp_path / "attempt_0" / str(r) for r in (0, 1, 2)]
    for rank in ranks:
        (rank / "worker").mkdir(parents=True)
    agent = SimpleNamespace(
        _pcontext=SimpleNamespace(error_files={r: str(ranks[r] / "error.json") for r in (0, 1, 2)})
    )
    stuck_proc = _sleeper()
    busy_proc = _sleeper("while True: pass")  # a final save, at work
    try:
        stuck = Worker(local_rank=0, global_rank=4, id=stuck_proc.pid)
        busy = Worker(local_rank=1, global_rank=5, id=busy_proc.pid)
        training = Worker(local_rank=2, global_rank=6, id=os.getpid())  # never signalled
        (ranks[0] / "worker" / f"teardown_started.{stuck.id}").touch()  # isolation 'user'
        (ranks[1] / f"program_returned.{busy.id}").touch()
        leaving = in_teardown(agent, [stuck, busy, training])
        assert leaving == {
            stuck.id: "it destroyed its process group",
            busy.id: "its program returned",
        }
        clock = [1000.0]
        supervision, path = _supervision(
            tmp_path, hang_rule=HangRule(5), progress_dir=tmp_path, clock=lambda: clock[0]
        )
        for worker in (stuck, busy, training):  # every one stopped beating long ago
            progress_file(tmp_path, worker.local_rank).touch()
            os.utime(progress_file(tmp_path, worker.local_rank), (900.0, 900.0))
        workers = [stuck, busy, training]
        assert [w for w, _, _ in supervision.find_hung(workers, leaving)] == [training]
        assert supervision.find_stuck_teardowns(workers, leaving) == []  # the window opens
        # The busy one uses more than 1 % of the 30 s window, however loaded the machine.
        used = psutil.Process(busy.id).cpu_times()
        deadline = time.monotonic() + 60
        while sum(psutil.Process(busy.id).cpu_times()[:2]) < sum(used[:2]) + 0.5:
            assert time.monotonic() < deadline, "the busy process got no CPU in 60 s"
            time.sleep(0.1)
        clock[0] += TEARDOWN_IDLE_S
        found = supervision.find_stuck_teardowns(workers, leaving)
        assert [w for w, _ in found] == [stuck]

        supervision.end_stuck_teardowns(found)
        _, stderr = stuck_proc.communicate(timeout=10)
        assert stuck_proc.returncode == -9
        assert "most recent call first" in stderr  # faulthandler's dump
        assert busy_proc.poll() is None
        assert supervision.find_stuck_teardowns(workers, leaving) == []  # ended once
        ended = Failure(0, stuck.id, -9, "<N/A>", error_file="<N/A>")
        crashed = Failure(1, busy.id, 1, "<N/A>", error_file="<N/A>")
        assert supervision.ended_in_teardown({4: ended, 5: crashed}) is False
        assert supervision.ended_in_teardown({4: ended}) is True
        assert supervision.ended_in_teardown({4: ended}) is False  # spent
        supervision.teardown_pids.add(stuck.id)  # ended again, but the group failed otherwise:
        assert supervision.on_failed({4: ended, 5: crashed}) is False
        assert (supervision.teardown_pids, supervision.teardowns) == (set(), {})  # forgotten
        supervision.events.close()
        (hang,) = [e["data"] for e in _emitted(path) if e["kind"] == EventKind.HANG]
        assert (hang["global_rank"], hang["rule"], hang["peers_finished"]) == (4, "teardown", False)
        assert "after it destroyed its process group" in hang["derivation"]
    finally:
        for proc in (stuck_proc, busy_proc):
            proc.kill()
            proc.communicate(timeout=10)
