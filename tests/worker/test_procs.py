"""Process-tree handling against real processes.

The "middle" process plays the elastic agent: it starts a grandchild in a new
session (as torch does with each worker) and prints the grandchild's pid.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from worker import procs

REPO = Path(__file__).resolve().parents[2]

_MIDDLE = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    ignore = sys.argv[1] == "ignore-term"
    code = "import signal, time\\n"
    if ignore:
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
    code += "print('ready', flush=True)\\ntime.sleep(600)\\n"
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True
    )
    child.stdout.readline()  # its SIGTERM disposition is in place
    print(child.pid, flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        return procs.is_alive(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def marker() -> dict[str, str]:
    return {"RELAUNCH_ATTEMPT_ID": uuid.uuid4().hex, "RELAUNCH_NODE_NAME": "procs-test"}


@pytest.fixture
def spawned() -> Iterator[list[int]]:
    pids: list[int] = []
    yield pids
    for pid in pids:  # never leave a sleeper behind, whatever the test did
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _start_middle(
    marker: dict[str, str], spawned: list[int], mode: str = "plain"
) -> tuple[subprocess.Popen[str], int]:
    middle = subprocess.Popen(
        [sys.executable, "-c", _MIDDLE, mode],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **marker},
    )
    assert middle.stdout is not None
    grandchild = int(middle.stdout.readline())
    spawned.extend([middle.pid, grandchild])
    return middle, grandchild


def test_descendants_sees_a_new_session_grandchild(
    marker: dict[str, str], spawned: list[int]
) -> None:
    middle, grandchild = _start_middle(marker, spawned)
    assert psutil.Process(grandchild).pid in [p.pid for p in procs.descendants(middle.pid)]
    assert os.getsid(grandchild) != os.getsid(middle.pid)
    outcome = procs.kill_tree(middle.pid, 2.0)
    assert outcome.clean
    assert not _alive(grandchild) and not _alive(middle.pid)
    assert middle.pid in outcome.exit_codes  # our child, reaped by kill_tree
    middle.returncode = outcome.exit_codes[middle.pid]


def test_kill_tree_sigkills_what_ignores_sigterm(
    marker: dict[str, str], spawned: list[int]
) -> None:
    middle, grandchild = _start_middle(marker, spawned, "ignore-term")
    started = time.monotonic()
    outcome = procs.kill_tree(middle.pid, 0.5)
    assert outcome.clean
    assert not _alive(grandchild)
    assert time.monotonic() - started >= 0.5
    middle.poll()


def test_kill_tree_finds_an_orphan_by_its_environment(
    marker: dict[str, str], spawned: list[int]
) -> None:
    middle, grandchild = _start_middle(marker, spawned)
    middle.kill()
    middle.wait()
    assert _alive(grandchild)  # the orphan outlives its parent: the trap
    assert procs.descendants(middle.pid) == []
    outcome = procs.kill_tree(middle.pid, 1.0, marker=marker)
    assert outcome.clean
    assert not _alive(grandchild)


def test_find_by_env_needs_every_pair(marker: dict[str, str], spawned: list[int]) -> None:
    middle, grandchild = _start_middle(marker, spawned)
    found = {p.pid for p in procs.find_by_env(marker)}
    assert found == {middle.pid, grandchild}
    assert procs.find_by_env({**marker, "RELAUNCH_NODE_NAME": "other"}) == []
    assert procs.find_by_env({}) == []
    procs.kill_tree(middle.pid, 1.0, marker=marker)
    middle.poll()


_SUBREAPER_DRIVER = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys
    import psutil
    from worker import procs

    procs.become_subreaper()
    middle = subprocess.Popen(
        [sys.executable, "-c", sys.argv[1], "ignore-term"], stdout=subprocess.PIPE, text=True
    )
    grandchild = int(middle.stdout.readline())
    os.kill(middle.pid, signal.SIGKILL)   # the launcher dies hard
    middle.wait()
    ppid = psutil.Process(grandchild).ppid()
    mine = [p.pid for p in procs.descendants(os.getpid())]
    outcome = procs.kill_tree(middle.pid, 0.3, known=[psutil.Process(grandchild)])
    left = procs.descendants(os.getpid())
    print(json.dumps({"me": os.getpid(), "ppid": ppid, "grandchild": grandchild,
                      "mine": mine, "clean": outcome.clean, "left": [p.pid for p in left]}))
    """
)


def test_subreaper_adopts_orphans_and_kill_tree_leaves_nothing() -> None:
    run = subprocess.run(
        [sys.executable, "-c", _SUBREAPER_DRIVER, _MIDDLE],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["ppid"] == result["me"]  # re-parented to the subreaper, not to init
    assert result["grandchild"] in result["mine"]
    assert result["clean"] and result["left"] == []
    assert not _alive(result["grandchild"])


_PREVIOUS_LIFE = textwrap.dedent(
    """
    import subprocess, sys, time
    import psutil
    from worker import procs

    ledger = procs.PidLedger(__import__("pathlib").Path(sys.argv[1]))
    worker = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    ledger.write({7: [procs.ProcessId.of(psutil.Process(worker.pid))]})
    print(worker.pid, flush=True)
    time.sleep(600)
    """
)


def test_ledger_lets_a_new_life_kill_what_the_previous_one_left(
    tmp_path: Path, spawned: list[int]
) -> None:
    ledger_path = tmp_path / "pids.json"
    previous = subprocess.Popen(
        [sys.executable, "-c", _PREVIOUS_LIFE, str(ledger_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert previous.stdout is not None
    leftover = int(previous.stdout.readline())
    spawned.append(leftover)
    previous.kill()  # the agent crashes; its worker lives on
    previous.wait()
    assert _alive(leftover)

    # An unrelated live process recorded with another create time: pid reuse.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    spawned.append(bystander.pid)
    ledger = procs.PidLedger(ledger_path)
    entries = ledger.read()
    entries[8] = [procs.ProcessId(bystander.pid, psutil.Process(bystander.pid).create_time() - 5)]
    ledger.write(entries)

    assert procs.kill_leftovers(procs.PidLedger(ledger_path), 1.0) == 1
    assert not _alive(leftover)
    assert _alive(bystander.pid)
    assert procs.PidLedger(ledger_path).read() == {}
    bystander.kill()
    bystander.wait()


def test_ledger_ignores_a_damaged_file(tmp_path: Path) -> None:
    path = tmp_path / "pids.json"
    path.write_text("{not json")
    assert procs.PidLedger(path).read() == {}
    assert procs.PidLedger(tmp_path / "missing.json").read() == {}
