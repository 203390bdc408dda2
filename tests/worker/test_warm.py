"""Warm worker starts: a worker forked from the zygote is the process ``python`` would
have started (``worker.zygote``, ``worker.warm``)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from worker import warm, zygote

REPO = Path(__file__).resolve().parents[2]
JOB_UID = 200_977  # no job of the suite's clusters gets this uid

_FACTS = textwrap.dedent(
    """
    import ctypes, getpass, json, os, site, sys, sysconfig, tempfile
    import numpy, torch
    import torch._dynamo.package as dynamo_package
    import helper
    status = open("/proc/self/status").read().splitlines()

    def mentions(path):
        # Module-level strings (and torch's config values) that name ``path``.
        found = []
        for name, module in list(sys.modules.items()):
            values = list(vars(module).items()) if module is not None else []
            config = getattr(module, "_config", None)
            for key in config if isinstance(config, dict) else {}:
                try:
                    values.append((key, getattr(module, key)))
                except Exception:
                    pass
            for key, value in values:
                items = value if isinstance(value, (list, tuple)) else [value]
                if any(isinstance(v, str) and path in v for v in items):
                    found.append(f"{name}.{key}")
        return sorted(found)

    facts = {
        "spare_dir_mentions": mentions(os.environ.get("SPARE_DIR", "/no/such/dir")),
        "tmp": tempfile.gettempdir(),
        "user_site": [site.USER_SITE, sysconfig.get_config_var("userbase")],
        "user": getpass.getuser(),
        "compile_cache": [
            os.environ.get("TORCHINDUCTOR_CACHE_DIR"), dynamo_package.DynamoCache._path_prefix
        ],
        "dumpable": ctypes.CDLL(None).prctl(3, 0, 0, 0, 0),
        "caps": [line for line in status if line.startswith(("Cap", "NoNewPrivs", "Seccomp"))],
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "umask": os.umask(0o022),
        "argv": sys.argv,
        "file": __file__,
        "name": __name__,
        "path": sys.path,
        "cwd": os.getcwd(),
        "rank": os.environ.get("RANK"),
        "uids": os.getresuid(),
        "groups": os.getgroups(),
        "session_leader": os.getsid(0) == os.getpid(),
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
        "comm": open("/proc/self/comm").read().strip(),
        "threads_setting": torch.get_num_threads(),
        "write_through": sys.stdout.write_through,
        "isolated": sys.flags.isolated,
        "random": numpy.random.rand(),
        "stdin": os.read(0, 10).decode(),
        "helper": helper.VALUE,
        "cuda": torch.cuda.is_initialized(),
    }
    print(json.dumps(facts))
    print("to stderr", file=sys.stderr)
    sys.exit(7)
    """
)

_SLEEPER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    here = Path(__file__).parent
    (here / "sleeper.ready").touch()
    code = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    while not (here / "sleeper.go").exists():
        time.sleep(0.05)
    sys.exit(code)
    """
)


# The job's own code in place of the zygote (a worker/ package on its PYTHONPATH).
_HOSTILE_ZYGOTE = textwrap.dedent(
    """
    import array, json, os, socket, sys
    sock = socket.socket(fileno=int(sys.argv[sys.argv.index("--fd") + 1]))
    sock.send(json.dumps({"ready": os.getpid(), "import_s": 0}).encode())
    while True:
        data, _, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(16))
        if not data:
            break
        request = json.loads(data)
        if os.environ["MODE"] == "lie":  # "my child" is the launcher's other process
            fd = os.pidfd_open(int(os.environ["VICTIM"]))
            reply = {"forked": request["fork"], "pid": int(os.environ["VICTIM"])}
            fds = [fd]
        else:  # junk, with descriptors to leak, again and again
            reply, fds = {"junk": 1}, list(os.pipe())
        for _ in range(1 if os.environ["MODE"] == "lie" else 50):
            try:
                sock.sendmsg(
                    [json.dumps(reply).encode()],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))],
                )
            except OSError:
                sys.exit(0)
    """
)


def _drive(scenario: str, work: Path, uid: int | None = None) -> dict[str, Any]:
    (work / "sub").mkdir(exist_ok=True)
    (work / "sub" / "main.py").write_text(_FACTS)
    (work / "sub" / "helper.py").write_text("VALUE = 'beside the script'\n")
    (work / "sleeper.py").write_text(_SLEEPER)
    (work / "quick.py").write_text("print('quick')\n")
    (work / "shadow").mkdir(exist_ok=True)  # beside a module only the zygote had imported
    (work / "shadow" / "main.py").write_text("import sympy\n")
    (work / "shadow" / "sympy.py").write_text("VALUE = 1\n")
    (work / "beside").mkdir(exist_ok=True)  # beside one a cold worker has imported too
    (work / "beside" / "main.py").write_text(
        "import random, sys\nsys.exit(0 if random.random else 3)\n"
    )
    (work / "beside" / "random.py").write_text("raise SystemExit(4)\n")
    # A working directory with a module the zygote imported (pydantic's colorsys), which a
    # cold zygote started there would take from there: this one works as the stdlib's.
    (work / "withmodule").mkdir(exist_ok=True)
    (work / "withmodule" / "colorsys.py").write_text(
        "import os, sysconfig\n"
        "exec(open(os.path.join(sysconfig.get_paths()['stdlib'], 'colorsys.py')).read())\n"
    )
    planted = work / "planted" / "worker"
    planted.mkdir(parents=True, exist_ok=True)
    (planted / "__init__.py").write_text("")
    (planted / "zygote.py").write_text(_HOSTILE_ZYGOTE)
    work.chmod(0o777)
    for path in work.rglob("*"):
        path.chmod(0o777 if path.is_dir() else 0o666)
    run = subprocess.run(
        [sys.executable, "-m", "tests.worker.warm_driver", scenario, str(work)]
        + ([] if uid is None else [str(uid)]),
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result: dict[str, Any] = json.loads(run.stdout.splitlines()[-1])
    return result


def _facts(run: dict[str, Any]) -> dict[str, Any]:
    assert run["code"] == 7, run
    assert run["stderr"].strip().endswith("to stderr"), run["stderr"]
    facts: dict[str, Any] = json.loads(run["stdout"])
    return facts


@pytest.mark.parametrize("uid", [None, JOB_UID], ids=["same-user", "job-user"])
def test_a_forked_worker_is_the_process_python_would_have_started(
    tmp_path: Path, uid: int | None
) -> None:
    result = _drive("fidelity", tmp_path, uid)
    cold, warm_one, warm_two = (_facts(result[k]) for k in ("cold", "warm", "warm2"))
    # Each process draws its own numpy random state, as a new interpreter does.
    assert len({cold.pop("random"), warm_one.pop("random"), warm_two.pop("random")}) == 3
    assert (cold.pop("rank"), warm_one.pop("rank"), warm_two.pop("rank")) == (
        "cold",
        "warm",
        "warm2",
    )
    assert warm_one == cold, (warm_one, cold)
    assert warm_two == cold
    script = str(tmp_path / "sub" / "main.py")
    assert cold["argv"] == [script, "--lr", "0.1"]
    assert cold["file"] == script and cold["name"] == "__main__"
    assert cold["path"][0] == str(tmp_path / "sub")
    assert cold["fds"] == [0, 1, 2, 3]  # 3: the listing's own
    assert cold["stdin"] == "" and cold["cuda"] is False
    assert cold["threads_setting"] == 1  # the worker's OMP_NUM_THREADS, not the zygote's 3
    expected_uid = os.getuid() if uid is None else uid
    assert cold["uids"] == [expected_uid] * 3
    assert result["zygote_uid"] == expected_uid
    if uid is not None:
        assert cold["groups"] == []  # no supplementary groups
    # A start-up error reaches the error file, whichever way the worker started.
    for how in ("cold_missing", "warm_missing"):
        assert result[how]["code"] == 1, result[how]
        assert "EntrypointNotFound" in result[how]["error_file"], result[how]


@pytest.mark.parametrize("uid", [None, JOB_UID], ids=["same-user", "job-user"])
def test_a_spare_zygote_loaded_as_root_becomes_the_zygote_a_cold_start_would_have_been(
    tmp_path: Path, uid: int | None
) -> None:
    result = _drive("spare_fidelity", tmp_path, uid)
    assert "a spare loaded before the job" in result["ready"], result["ready"]
    cold, warm_one, warm_two = (_facts(result[k]) for k in ("cold", "warm", "warm2"))
    assert len({cold.pop("random"), warm_one.pop("random"), warm_two.pop("random")}) == 3
    for facts in (cold, warm_one, warm_two):
        facts.pop("rank")
    assert warm_one == cold, (warm_one, cold)
    assert warm_two == cold
    home = str(tmp_path / "home")
    # What the spare's imports computed from root's HOME, TMPDIR and name, computed again.
    assert cold["tmp"] == home
    assert cold["user_site"][0].startswith(home + "/.local/")
    assert cold["compile_cache"][0].startswith(home + "/torchinductor_")
    assert cold["dumpable"] == 1
    assert cold["threads_setting"] == 1
    assert cold["spare_dir_mentions"] == []  # nothing still points into root's directory
    assert cold["path"][0] == str(tmp_path / "sub")
    expected_uid = os.getuid() if uid is None else uid
    assert cold["uids"] == [expected_uid] * 3
    assert result["zygote_uid"] == expected_uid
    if uid is not None:
        assert cold["groups"] == []
        assert cold["user"] == f"relaunch-{uid}"
        # Nothing of root's powers is left: no capability in any set but the bound.
        caps = dict(line.split(":\t") for line in cold["caps"])
        assert all(int(caps[name], 16) == 0 for name in ("CapInh", "CapPrm", "CapEff", "CapAmb"))


def test_a_spare_zygote_is_passed_over_where_a_cold_start_would_import_otherwise(
    tmp_path: Path,
) -> None:
    result = _drive("spare_refused", tmp_path, JOB_UID)
    for case in ("env", "workdir"):
        assert not result[case]["zygote_is_the_spare"], result
        assert result[case]["spare_ended"] != 0 or case == "env", result
        assert "the spare zygote was not used" in result[case]["message"], result
    assert "PYTHONHASHSEED" in result["env"]["message"]
    assert "'colorsys'" in result["workdir"]["message"]
    imports = result["imports"]
    assert "the job's CI differs from the spare's, which its imports read" in imports["message"]
    assert imports["spare_ended"] in (1, -9)  # it refused and ended, or was ended
    assert imports["fork_code"] == 0, imports  # forked from the zygote started in its place


def test_torch_ends_a_forked_worker_through_its_session(tmp_path: Path) -> None:
    result = _drive("signals", tmp_path, JOB_UID)
    assert result["pgid"] == result["pid"]  # a session of its own, as torch starts workers
    assert result["code"] == -15 and result["poll"] == -15


def test_a_zygote_that_dies_is_replaced_and_its_running_workers_are_still_followed(
    tmp_path: Path,
) -> None:
    result = _drive("zygote_dies", tmp_path, JOB_UID)
    assert result["orphan_code"] == warm.LOST_STATUS  # ended; its status went to its reaper
    assert result["events"][:3] == ["ready", "lost", "ready"], result
    assert result["second_pid"] != result["first_pid"]
    assert result["code_after"] == 0


def test_a_worker_that_cannot_be_forked_is_refused_with_the_reason(tmp_path: Path) -> None:
    result = _drive("refused", tmp_path, JOB_UID)
    assert len(result["reasons"]) == 3, result
    assert "not relaunch's bootstrap" in result["reasons"][0]
    assert "LD_PRELOAD" in result["reasons"][1]
    # A cold worker would import the sympy.py beside the script; a fork has torch's.
    assert "'sympy'" in result["reasons"][2]
    # A cold worker has the stdlib's random before the script runs, and so has a fork.
    assert result["beside_code"] == 0


def test_a_zygote_run_by_the_jobs_code_can_make_the_launcher_signal_nothing_of_anyone_else(
    tmp_path: Path,
) -> None:
    result = _drive("hostile", tmp_path, JOB_UID)
    assert "failed its check" in result["lie"] and "not a child" in result["lie"], result
    assert result["victim_alive"] is True
    assert "refused" in result["junk"] or "gone" in result["junk"], result
    # Given up at its first junk message; every descriptor it sent was closed.
    assert result["junk_fds_leaked"] == 0 and result["lie_fds_leaked"] == 0, result
    assert result["junk_events"][:2] == ["ready", "lost"], result


def test_what_may_differ_between_a_worker_and_its_zygote() -> None:
    args = [sys.executable, "-u", "-m", "worker.bootstrap", "train.py"]
    zygote_env = {"PATH": "/bin", "PYTHONPATH": "/code", "OMP_NUM_THREADS": "2"}
    per_worker = {
        **zygote_env,
        "RANK": "3",
        "LOCAL_RANK": "1",
        "MASTER_PORT": "29500",
        "OMP_NUM_THREADS": "1",
        "TORCHELASTIC_ERROR_FILE": "/x/error.json",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    assert warm.cold_start_reason(args, per_worker, zygote_env) is None
    for name, value in (("PYTHONPATH", "/other"), ("LD_PRELOAD", "x.so"), ("TORCH_LOGS", "+all")):
        reason = warm.cold_start_reason(args, {**per_worker, name: value}, zygote_env)
        assert reason is not None and name in reason
    removed = {k: v for k, v in per_worker.items() if k != "PATH"}
    assert "PATH" in (warm.cold_start_reason(args, removed, zygote_env) or "")
    other = [sys.executable, "-m", "worker.bootstrap", "train.py"]  # no -u
    assert warm.cold_start_reason(other, per_worker, zygote_env) is not None


def test_the_variables_python_code_reads_are_recorded_not_those_only_listed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RELAUNCH_T_READ", "1")
    with zygote.EnvironmentReads() as reads:
        os.environ.get("RELAUNCH_T_GET")
        _ = "RELAUNCH_T_IN" in os.environ
        os.getenv("RELAUNCH_T_GETENV")
        _ = os.environ["RELAUNCH_T_READ"]
        listed = [k for k in os.environ if k.startswith("RELAUNCH_T")]
    read = {"RELAUNCH_T_GET", "RELAUNCH_T_IN", "RELAUNCH_T_GETENV", "RELAUNCH_T_READ"}
    assert reads.names == read
    assert listed == ["RELAUNCH_T_READ"]
    with zygote.EnvironmentReads() as reads:
        copied = os.environ.copy()  # a copy may be looked in for anything later
    assert reads.names == set(os.environ) and copied["RELAUNCH_T_READ"] == "1"
    os.environ.get("RELAUNCH_T_AFTER")
    assert "RELAUNCH_T_AFTER" not in reads.names  # the recording is over


def test_a_spare_refuses_a_job_whose_value_differs_for_what_its_imports_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(zygote, "_read_at_import", frozenset({"APP_MODE", "HOME", "RANK"}))
    monkeypatch.setattr(zygote, "_ENV_AT_START", {"APP_MODE": "a", "HOME": "/root"})
    # What adoption computes again (HOME) and what is set per worker (RANK) may differ.
    assert zygote.import_read_refusal({"APP_MODE": "a", "HOME": "/h", "RANK": "1"}) is None
    reason = zygote.import_read_refusal({"APP_MODE": "b"})
    assert reason is not None and "APP_MODE" in reason
    assert "APP_MODE" in (zygote.import_read_refusal({}) or "")


def test_the_zygote_does_not_fork_with_a_second_thread_or_with_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert "Python threads" in (zygote.fork_refusal() or "")
        pid, refusal = zygote._fork()  # forks this test process; the child ends at once
        assert pid != 0
        assert refusal is not None and "threads at the fork" in refusal
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # already reaped by _fork
    finally:
        stop.set()
        thread.join()
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    assert zygote.fork_refusal() is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert "CUDA" in (zygote.fork_refusal() or "")


def test_a_pid_the_zygote_names_is_believed_only_for_its_own_child_of_the_jobs_user() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; subprocess.run(['sleep', '30'])"]
    )
    child = None
    try:
        for _ in range(200):
            found = [int(p) for p in Path(f"/proc/{parent.pid}/task/{parent.pid}/children")
                     .read_text().split()]  # fmt: skip
            if found:
                child = found[0]
                break
            threading.Event().wait(0.05)
        assert child is not None
        pidfd = os.pidfd_open(child)
        try:
            assert warm.verified_pid(pidfd, parent.pid, os.getuid()) == child
            with pytest.raises(PermissionError, match="not a child"):
                warm.verified_pid(pidfd, os.getpid(), None)
            with pytest.raises(PermissionError, match="not the job's"):
                warm.verified_pid(pidfd, parent.pid, JOB_UID)
        finally:
            os.close(pidfd)
        own = os.pidfd_open(os.getpid())  # this test process: nobody's worker
        try:
            with pytest.raises(PermissionError):
                warm.verified_pid(own, os.getppid(), JOB_UID)
        finally:
            os.close(own)
    finally:
        parent.kill()
        parent.wait()
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, 9)
