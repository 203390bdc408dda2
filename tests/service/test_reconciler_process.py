"""The reconciler in a child process of the controller (``service.reconciler_process``),
as ``relaunch server`` runs it: it places jobs, its metrics reach ``/metrics``, it is
started again if it dies, it hands the lease back when the controller stops, and it dies
with a controller that is killed."""

from __future__ import annotations

import gc
import logging
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import psutil
import pytest
from pydantic import SecretStr

from service import reconciler_process
from service.api.app import create_app
from service.db import make_engine, make_session_factory, transaction, upgrade_to_head
from service.leader import current
from service.models import Role
from service.reconciler import utcnow
from service.reconciler_process import PROCESS_NAME, ReconcilerProcess
from service.settings import ControllerSettings
from tests.helpers import subprocess_environ
from tests.service.helpers import Cluster, bearer, heartbeat, register, submit

SCRAPE_TOKEN = "scrape-" + "s" * 32
T = TypeVar("T")


def until(what: Callable[[], T | None], timeout_s: float = 30.0) -> T:
    """``what()`` once it is truthy; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = what()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout_s} s"
        time.sleep(0.1)


# The tests of the two processes' mechanics (signals, pipes, respawns, the collector) run on
# SQLite only; those whose subject is also the database (the child's own pool placing jobs,
# the lease handed back) run on both.
PROCESSES_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


@pytest.fixture
def live_settings(settings: ControllerSettings) -> ControllerSettings:
    return settings.model_copy(
        update={"metrics_token": SecretStr(SCRAPE_TOKEN), "leader_lease_s": 3.0}
    )


@pytest.fixture
def live(live_settings: ControllerSettings) -> Iterator[Cluster]:
    """The app with its background loops and the wall clock, as the server runs it."""
    with Cluster(create_app(live_settings)) as client:
        client.user_token = client.add_user("root", Role.ADMIN)
        yield client


def child(api: Cluster, other_than: int | None = None) -> psutil.Process:
    """The running reconciler process (one other than the pid ``other_than``)."""
    reconciler = api.app.state.reconciler  # type: ignore[attr-defined]
    assert isinstance(reconciler, ReconcilerProcess)

    def running() -> psutil.Process | None:
        pid = reconciler.pid
        if pid is None or pid == other_than:
            return None
        try:
            return psutil.Process(pid)
        except psutil.NoSuchProcess:
            return None

    return until(running)


def metric(api: Cluster, line_start: str) -> float:
    """The value of the first sample of ``/metrics`` whose line starts so (0 if none)."""
    r = api.get("/metrics", headers=bearer(SCRAPE_TOKEN))
    assert r.status_code == 200, r.text
    for line in r.text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def placed_on(api: Cluster, node: int) -> list[int]:
    return [a["job_id"] for a in heartbeat(api, node)]


def test_the_reconciler_runs_in_a_child_process_that_places_jobs_and_sends_its_metrics(
    live: Cluster,
) -> None:
    process = child(live)
    assert process.ppid() == os.getpid()
    until(lambda: process.name() == PROCESS_NAME)  # named once it has started
    # Nicer by RELAUNCH_RECONCILER_NICE (-10) than the controller, which these tests run as
    # root, once it has its settings; its threads too.
    assert os.geteuid() == 0
    assert ControllerSettings.model_fields["reconciler_nice"].default == -10
    nice = os.getpriority(os.PRIO_PROCESS, 0) - 10
    until(lambda: {t.id for t in process.threads()} and process.nice() == nice)
    assert {os.getpriority(os.PRIO_PROCESS, t.id) for t in process.threads()} == {nice}
    node = register(live, "a")
    job_id = submit(live, nnodes="1:1")
    assert until(lambda: placed_on(live, node)) == [job_id]
    # Sent after each pass: the pass that placed the job, and the leader it ran as.
    until(lambda: metric(live, 'relaunch_reconcile_actions_total{action="PlaceJob"}') == 1)
    assert metric(live, "relaunch_reconcile_pass_seconds_count") >= 1
    assert metric(live, "relaunch_controller_leader") == 1
    # Served once: the controller's own registry holds no second, idle copy.
    text = live.get("/metrics", headers=bearer(SCRAPE_TOKEN)).text
    assert text.count("# TYPE relaunch_reconcile_pass_seconds histogram") == 1


@PROCESSES_ONLY
def test_what_the_controller_made_at_start_is_left_out_of_garbage_collections(
    live_settings: ControllerSettings,
) -> None:
    """RELAUNCH_GC_FREEZE: frozen while the controller serves (a full collection then
    scans only what came since), unfrozen once it stops; not at all when turned off."""
    with Cluster(create_app(live_settings)):
        assert gc.get_freeze_count() > 10_000  # the service's modules, classes and tables
    assert gc.get_freeze_count() == 0
    with Cluster(create_app(live_settings.model_copy(update={"gc_freeze": False}))):
        assert gc.get_freeze_count() == 0


@PROCESSES_ONLY
def test_a_reconciler_process_that_ends_no_pass_is_killed_and_started_again(
    live_settings: ControllerSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped (SIGSTOP), it would never exit by itself: the controller kills it once it
    has been silent too long, and the next one places jobs."""
    # Long enough for a new child to start and end its first pass on a busy machine.
    monkeypatch.setattr(reconciler_process, "silence_allowed", lambda _settings: 10.0)
    with Cluster(create_app(live_settings)) as live:
        live.user_token = live.add_user("root", Role.ADMIN)
        first = child(live)
        first.send_signal(signal.SIGSTOP)
        second = child(live, other_than=first.pid)
        assert not first.is_running() or first.status() == psutil.STATUS_ZOMBIE
        assert second.status() != psutil.STATUS_STOPPED
        node = register(live, "a")
        job_id = submit(live, nnodes="1:1")
        assert until(lambda: placed_on(live, node)) == [job_id]


@PROCESSES_ONLY
def test_a_registration_waits_for_the_child_s_pass(live: Cluster) -> None:
    """A registration's answer waits for a pass begun after it (across the processes):
    the node's first heartbeat already brings a job that waited for a node."""
    until(lambda: metric(live, "relaunch_controller_leader") == 1)  # the child leads
    job_id = submit(live, nnodes="1:1")
    node = register(live, "a")
    assert placed_on(live, node) == [job_id]


@PROCESSES_ONLY
def test_a_reconciler_process_that_dies_is_started_again(live: Cluster) -> None:
    first = child(live)
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    second = child(live, other_than=first.pid)
    assert second.ppid() == os.getpid()
    node = register(live, "b")
    job_id = submit(live, nnodes="1:1")
    assert until(lambda: placed_on(live, node)) == [job_id]


@PROCESSES_ONLY
def test_wakes_never_wait_on_a_reconciler_process_that_died(live: Cluster) -> None:
    """A child killed as it rests between passes (where it spends most of its life) leaves
    nothing a wake could block on: every wake, waiting or not, returns, and a registration
    waiting for a pass is answered by the next child."""
    reconciler = live.app.state.reconciler  # type: ignore[attr-defined]
    until(lambda: metric(live, "relaunch_controller_leader") == 1)
    first = child(live)
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    answers: list[bool] = []
    wakes = threading.Thread(
        target=lambda: answers.extend(reconciler.wake(w) for w in (0.0, 0.2, 0.0, 0.2)),
        daemon=True,
    )
    wakes.start()
    wakes.join(30)
    assert not wakes.is_alive(), "a wake blocked on the dead reconciler process"
    assert answers[0] is False and answers[2] is False  # wakes that do not wait
    child(live, other_than=first.pid)
    until(lambda: metric(live, "relaunch_controller_leader") == 1)
    assert reconciler.wake(30.0), "the new child answers a wake that waits"


def test_a_stopped_controller_s_child_hands_the_lease_back_and_exits(
    live_settings: ControllerSettings,
) -> None:
    # A lease that outlasts the controller's wait for its child: free after the stop only
    # if the child handed it back, not because it expired.
    lasting = live_settings.model_copy(update={"leader_lease_s": 120.0})
    with Cluster(create_app(lasting)) as api:
        process = child(api)
        until(lambda: metric(api, "relaunch_controller_leader") == 1)
    assert not process.is_running()
    engine = make_engine(live_settings.db_url)
    try:
        with transaction(make_session_factory(engine)) as session:
            assert current(session, utcnow()) is None
    finally:
        engine.dispose()


@PROCESSES_ONLY
def test_a_killed_controller_takes_its_reconciler_process_with_it(
    live_settings: ControllerSettings, tmp_path: Path
) -> None:
    """SIGKILL of the controller alone: its child must not live on, holding the lease."""
    upgrade_to_head(live_settings.db_url)
    script = textwrap.dedent(
        """
        import sys, time
        from service.metrics import Relayed
        from service.reconciler_process import ReconcilerProcess
        from service.settings import ControllerSettings

        reconciler = ReconcilerProcess(ControllerSettings(), Relayed())
        reconciler.start()
        while reconciler.pid is None:
            time.sleep(0.05)
        print(reconciler.pid, flush=True)
        time.sleep(600)
        """
    )
    env = {
        **os.environ,
        "RELAUNCH_DATA_DIR": str(live_settings.data_dir),
        "RELAUNCH_DATABASE_URL": live_settings.db_url,
        "RELAUNCH_LEADER_LEASE_S": "3",
    }
    if live_settings.secrets_keys is not None:
        env["RELAUNCH_SECRETS_KEYS"] = live_settings.secrets_keys.get_secret_value()
    with subprocess.Popen(
        [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True
    ) as controller:
        try:
            assert controller.stdout is not None
            pid = int(controller.stdout.readline())
            process = psutil.Process(pid)
            assert process.ppid() == controller.pid
            until(lambda: process.name() == PROCESS_NAME)  # named after it set the signal
            # Stopped, it cannot see its pipe close and end itself: only the kernel's
            # parent-death signal (SIGKILL, which a stopped process does not hold off) ends it.
            process.send_signal(signal.SIGSTOP)
        finally:
            controller.kill()
    gone, alive = psutil.wait_procs([process], timeout=10)
    for left in alive:
        left.kill()
    assert gone, "the reconciler process outlived its controller"


@PROCESSES_ONLY
def test_a_serving_controller_scans_its_youngest_objects_at_its_own_threshold(
    live_settings: ControllerSettings,
) -> None:
    """RELAUNCH_GC_YOUNG_THRESHOLD while the controller serves; Python's own once it stops."""
    before = gc.get_threshold()
    with Cluster(create_app(live_settings)):
        assert gc.get_threshold() == (live_settings.gc_young_threshold, *before[1:])
    assert gc.get_threshold() == before
    with Cluster(create_app(live_settings.model_copy(update={"gc_young_threshold": 5_000}))):
        assert gc.get_threshold()[0] == 5_000
    assert gc.get_threshold() == before


def test_a_child_stopped_part_way_through_a_message_is_killed_once_silent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child stopped while it writes a message has sent its length and part of it: a read
    of the rest would wait for ever. The controller hears in a thread of its own, so the
    silence still ends it."""
    from multiprocessing.connection import Connection

    from service.metrics import Relayed

    monkeypatch.setattr(reconciler_process, "silence_allowed", lambda _settings: 1.0)
    # No database: the controller's side of the pipe is all this test runs.
    settings = ControllerSettings(data_dir=tmp_path, database_url=f"sqlite:///{tmp_path}/db")
    read_end, write_end = os.pipe()
    half_sent = (
        "import os, sys, time\n"
        "os.write(int(sys.argv[1]), (1000).to_bytes(4, 'big') + b'x' * 10)\n"
        "time.sleep(120)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", half_sent, str(write_end)], pass_fds=(write_end,)
    )
    os.close(write_end)
    hearing = threading.Thread(
        target=ReconcilerProcess(settings, Relayed())._hear,
        args=(Connection(read_end, writable=False), child),
        daemon=True,
    )
    try:
        hearing.start()
        hearing.join(60)
        assert not hearing.is_alive(), "still reading the half-sent message"
        assert child.wait(10) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()


def test_without_the_right_to_lower_its_nice_the_reconciler_keeps_it_and_says_so() -> None:
    """Lowering a nice value needs CAP_SYS_NICE: a controller run as another user, at the
    usual ``RLIMIT_NICE`` of 0, keeps its own for the reconciler's process (the job users'
    ``nobody`` here)."""
    code = (
        "import logging, os\n"
        "from service.reconciler_process import lower_nice\n"
        "logging.basicConfig()\n"
        "before = os.getpriority(os.PRIO_PROCESS, 0)\n"
        "lower_nice(-5)\n"
        "print(before, os.getpriority(os.PRIO_PROCESS, 0))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=subprocess_environ(),
        cwd="/",
        user="nobody",
        # Lowering a limit is allowed to anyone: the usual one, whatever the runner's.
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NICE, (0, 0)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    before, after = done.stdout.split()
    assert before == after, done.stdout
    assert f"keeps nice {before}: lowering it by 5 needs CAP_SYS_NICE" in done.stderr


@pytest.mark.parametrize(
    ("limit", "ends_at", "said"),
    [
        (25, -5, "runs at nice -5, not -10: RLIMIT_NICE allows no lower"),
        (0, 0, "keeps nice 0: lowering it by 10 needs CAP_SYS_NICE or a higher RLIMIT_NICE"),
        (35, -10, None),  # the limit allows all that is asked: no fallback, nothing said
        (resource.RLIM_INFINITY, -10, None),
    ],
)
def test_without_the_right_the_reconciler_goes_as_low_as_rlimit_nice_allows(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    limit: int,
    ends_at: int,
    said: str | None,
) -> None:
    """The kernel's rule for a process without CAP_SYS_NICE (``setrlimit(2)``): its nice
    value may go no lower than 20 - ``RLIMIT_NICE``. Only the decision is tested here: this
    machine's root may not raise its own hard limit (no CAP_SYS_RESOURCE), and a process
    that is not root may not raise it either, so no real process can be given one."""
    nice = [0]

    def setpriority(which: int, who: int, value: int) -> None:
        if limit != resource.RLIM_INFINITY and value < 20 - limit:
            raise PermissionError(13, "Permission denied")
        nice[0] = value

    monkeypatch.setattr(reconciler_process.os, "getpriority", lambda which, who: nice[0])
    monkeypatch.setattr(reconciler_process.os, "setpriority", setpriority)
    monkeypatch.setattr(reconciler_process.resource, "getrlimit", lambda which: (limit, limit))
    with caplog.at_level(logging.WARNING, logger="service.reconciler_process"):
        reconciler_process.lower_nice(-10)
    assert nice == [ends_at]
    if said is None:
        assert caplog.messages == []
    else:
        assert any(said in m for m in caplog.messages), caplog.messages
