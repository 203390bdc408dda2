"""Drives ``worker.warm`` in a process of its own (which it makes a subreaper) for
tests/worker/test_warm.py; prints one JSON object with what it saw.

Usage: python -m tests.worker.warm_driver SCENARIO WORK_DIR [UID]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from worker.sandbox import JobUser
from worker.warm import ColdStart, ForkedProcess, SpareZygote, WarmStarter, offer_spare

BOOTSTRAP = [sys.executable, "-u", "-m", "worker.bootstrap"]


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, int | None]] = []
        self.changed = threading.Condition()

    def __call__(self, state: str, message: str, zygote: Any) -> None:
        with self.changed:
            self.events.append((state, message, None if zygote is None else zygote.pid))
            self.changed.notify_all()

    def wait_for(self, state: str, count: int = 1) -> None:
        with self.changed:
            done = self.changed.wait_for(
                lambda: sum(1 for e in self.events if e[0] == state) >= count, timeout=180
            )
        if not done:
            raise SystemExit(f"no {state} event: {self.events}")


def _starter(work: Path, uid: int | None, env: dict[str, str]) -> tuple[WarmStarter, Recorder]:
    recorder = Recorder()
    kwargs: dict[str, Any] = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    starter = WarmStarter(env=env, uid=uid, popen_kwargs=kwargs, on_event=recorder)
    recorder.wait_for("ready")
    return starter, recorder


def _outputs(work: Path, name: str) -> tuple[Any, Any]:
    out = open(work / f"{name}.out", "w")  # noqa: SIM115 - the worker holds them
    err = open(work / f"{name}.err", "w")  # noqa: SIM115
    os.fchmod(out.fileno(), 0o600)
    os.fchmod(err.fileno(), 0o600)
    return out, err


def _run_cold(args: list[str], env: dict[str, str], work: Path, name: str, uid: int | None) -> int:
    out, err = _outputs(work, name)
    kwargs: dict[str, Any] = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    # As torch starts a worker: a session of its own.
    proc = subprocess.Popen(
        args, env=env, cwd=work, stdout=out, stderr=err, start_new_session=True, **kwargs
    )
    code = proc.wait(120)
    out.close()
    err.close()
    return code


def _run_warm(
    starter: WarmStarter, args: list[str], env: dict[str, str], work: Path, name: str
) -> tuple[int, ForkedProcess]:
    out, err = _outputs(work, name)
    proc = starter.fork(args, env, out, err)
    code = proc.wait(120)
    out.close()
    err.close()
    return code, proc


def fidelity(work: Path, uid: int | None) -> dict[str, Any]:
    base = {**os.environ, "OMP_NUM_THREADS": "3"}
    starter, _ = _starter(work, uid, base)
    return _compare(starter, base, work, uid)


def spare_fidelity(work: Path, uid: int | None) -> dict[str, Any]:
    """As ``fidelity``, the zygote being a spare loaded as root before the job, in a
    directory of root's, with root's HOME, TMPDIR and names; the job's are its own, as a
    launcher gives them (``worker.sandbox._prepare``). Its thread count is the job's, as
    the agent makes it (``worker.attempt.spare_env``) for the jobs that may adopt it."""
    spare_dir = work / "spare"
    for path in (spare_dir, spare_dir / "home", spare_dir / "cwd"):
        path.mkdir(mode=0o700)
    spare_home = str(spare_dir / "home")
    spare_env = {**os.environ, "HOME": spare_home, "TMPDIR": spare_home}
    spare_env.update({"USER": "root", "LOGNAME": "root", "OMP_NUM_THREADS": "3"})
    home = work / "home"
    home.mkdir()
    if uid is not None:
        os.chown(home, uid, uid)
    base = {**os.environ, "OMP_NUM_THREADS": "3", "HOME": str(home), "TMPDIR": str(home)}
    base["SPARE_DIR"] = str(spare_dir)  # the facts look for module state still naming it
    priority = os.getpriority(os.PRIO_PROCESS, 0)
    os.nice(10)  # as an agent's spares load; the adoption gives the launcher's back
    spare = SpareZygote(spare_env, spare_dir / "cwd")
    os.setpriority(os.PRIO_PROCESS, 0, priority)
    if not spare.wait_loaded(180):
        raise SystemExit("the spare zygote did not load")
    offer_spare(spare)
    starter, recorder = _starter(work, uid, base)
    result = _compare(starter, base, work, uid)
    result["ready"] = recorder.events[0][1]
    result["spare_pid"] = spare.proc.pid
    return result


def spare_refused(work: Path, uid: int | None) -> dict[str, Any]:
    """A spare that cannot be the job's zygote: the job's environment sets a variable
    read at start-up (refused by the launcher), or its working directory holds a module
    the spare took from elsewhere (refused by the spare, as the job's user)."""
    result: dict[str, Any] = {}
    # A variable that torch's imports read (``CI``, by torch._functorch's config), otherwise
    # than the spare had it: the spare itself refuses, once loaded. A worker asked for at
    # once, before that answer, is a fork of the zygote started in the spare's place.
    spare_dir = work / "spare-imports"
    spare_dir.mkdir(mode=0o700)
    spare = SpareZygote({**os.environ, "HOME": str(spare_dir)}, spare_dir)
    offer_spare(spare)
    recorder = Recorder()
    kwargs: dict[str, Any] = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    env = {**os.environ, "CI": "not the spare's"}
    starter = WarmStarter(env=env, uid=uid, popen_kwargs=kwargs, on_event=recorder)
    out, err = _outputs(work, "imports")
    try:
        proc = starter.fork([*BOOTSTRAP, str(work / "quick.py")], env, out, err)
        forked: Any = proc.wait(120)
    except ColdStart as exc:
        forked = f"cold: {exc}"
    recorder.wait_for("ready")
    result["imports"] = {
        "message": recorder.events[0][1],
        "spare_ended": spare.proc.wait(30),
        "fork_code": forked,
    }
    starter.stop()
    for case in ("env", "workdir"):
        spare_dir = work / f"spare-{case}"
        spare_dir.mkdir(mode=0o700)
        spare = SpareZygote({**os.environ, "HOME": str(spare_dir)}, spare_dir)
        env = dict(os.environ)
        if case == "env":
            env["PYTHONHASHSEED"] = "7"
        else:
            os.chdir(work / "withmodule")  # the launcher's working directory is the job's
        offer_spare(spare)
        starter, recorder = _starter(work, uid, env)
        os.chdir(work)
        zygote = starter.zygote
        assert zygote is not None
        result[case] = {
            "message": recorder.events[0][1],
            "spare_ended": spare.proc.wait(30),
            "zygote_is_the_spare": zygote._proc.pid == spare.proc.pid,
        }
        starter.stop()
    return result


def _compare(
    starter: WarmStarter, base: dict[str, str], work: Path, uid: int | None
) -> dict[str, Any]:
    script = str(work / "sub" / "main.py")
    result: dict[str, Any] = {"zygote_uid": os.stat(f"/proc/{starter.zygote._proc.pid}").st_uid}  # type: ignore[union-attr]
    for how in ("cold", "warm", "warm2"):
        env = {**base, "RANK": how, "OMP_NUM_THREADS": "1"}
        args = [*BOOTSTRAP, script, "--lr", "0.1"]
        if how == "cold":
            code = _run_cold(args, env, work, how, uid)
        else:
            code, _ = _run_warm(starter, args, env, work, how)
        result[how] = {
            "code": code,
            "stdout": (work / f"{how}.out").read_text(),
            "stderr": (work / f"{how}.err").read_text(),
        }
    # A start-up error reaches the error file the same way.
    for how in ("cold", "warm"):
        error_file = work / f"{how}-error.json"
        env = {**base, "TORCHELASTIC_ERROR_FILE": str(error_file)}
        args = [*BOOTSTRAP, "-m", "no_such_module_here"]
        if how == "cold":
            code = _run_cold(args, env, work, f"{how}-missing", uid)
        else:
            code, _ = _run_warm(starter, args, env, work, f"{how}-missing")
        result[f"{how}_missing"] = {
            "code": code,
            "error_file": error_file.read_text() if error_file.exists() else "",
        }
    starter.stop()
    return result


def signals(work: Path, uid: int | None) -> dict[str, Any]:
    starter, _ = _starter(work, uid, dict(os.environ))
    script = str(work / "sleeper.py")
    out, err = _outputs(work, "sleeper")
    proc = starter.fork([*BOOTSTRAP, script], dict(os.environ), out, err)
    ready = work / "sleeper.ready"
    for _ in range(600):
        if ready.exists():
            break
        threading.Event().wait(0.05)
    pgid = os.getpgid(proc.pid)
    proc.signal_group(signal.SIGTERM)
    code = proc.wait(60)
    starter.stop()
    return {"pid": proc.pid, "pgid": pgid, "code": code, "poll": proc.poll()}


def zygote_dies(work: Path, uid: int | None) -> dict[str, Any]:
    starter, recorder = _starter(work, uid, dict(os.environ))
    first = starter.zygote
    assert first is not None
    script = str(work / "sleeper.py")
    out, err = _outputs(work, "orphan")
    proc = starter.fork([*BOOTSTRAP, script, "5"], dict(os.environ), out, err)
    first._proc.kill()  # the zygote, while its worker runs
    recorder.wait_for("ready", count=2)
    (work / "sleeper.go").touch()  # the worker may end now, with its own code
    code = proc.wait(60)  # known to have ended; how, only its reaper (not us) knows
    second = starter.zygote
    assert second is not None
    out2, err2 = _outputs(work, "after")
    again = starter.fork([*BOOTSTRAP, str(work / "quick.py")], dict(os.environ), out2, err2)
    code2 = again.wait(60)
    starter.stop()
    return {
        "orphan_code": code,
        "events": [e[0] for e in recorder.events],
        "first_pid": first.pid,
        "second_pid": second.pid,
        "code_after": code2,
    }


def refused(work: Path, uid: int | None) -> dict[str, Any]:
    starter, _ = _starter(work, uid, dict(os.environ))
    out, err = _outputs(work, "refused")
    reasons = []
    for args, env in (
        ([sys.executable, "-u", str(work / "quick.py")], dict(os.environ)),
        ([*BOOTSTRAP, str(work / "quick.py")], {**os.environ, "LD_PRELOAD": "libc.so.6"}),
        ([*BOOTSTRAP, str(work / "shadow" / "main.py")], dict(os.environ)),
    ):
        try:
            starter.fork(args, env, out, err)
        except ColdStart as exc:
            reasons.append(str(exc))
    # A random.py beside the script: a cold worker, too, has the stdlib's by then.
    beside = starter.fork(
        [*BOOTSTRAP, str(work / "beside" / "main.py")], dict(os.environ), out, err
    )
    code = beside.wait(60)
    starter.stop()
    return {"reasons": reasons, "beside_code": code}


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def hostile(work: Path, uid: int | None) -> dict[str, Any]:
    """A zygote replaced by the job's own code (a planted worker/zygote.py) that names
    another process as its child, or sends junk with descriptors."""
    victim = subprocess.Popen(["sleep", "60"])
    env = {**os.environ, "VICTIM": str(victim.pid), "PYTHONPATH": str(work / "planted")}
    result: dict[str, Any] = {}
    for mode in ("lie", "junk"):
        before = _open_fds()
        recorder = Recorder()
        kwargs: dict[str, Any] = (
            {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
        )
        zygote_env = {**env, "MODE": mode}
        starter = WarmStarter(env=zygote_env, uid=uid, popen_kwargs=kwargs, on_event=recorder)
        recorder.wait_for("ready")
        out, err = _outputs(work, f"hostile-{mode}")
        try:
            starter.fork([*BOOTSTRAP, str(work / "quick.py")], zygote_env, out, err)
            result[mode] = "forked"
        except ColdStart as exc:
            result[mode] = str(exc)
        starter.stop()
        out.close()
        err.close()
        threading.Event().wait(1.0)  # the reader thread closes what it received
        result[f"{mode}_fds_leaked"] = _open_fds() - before
        result[f"{mode}_events"] = [e[0] for e in recorder.events]
    result["victim_alive"] = victim.poll() is None
    victim.kill()
    victim.wait()
    return result


def main() -> None:
    # torch sets it in the environment of a process that imported torch._dynamo, as the test
    # runner may have before it started this one; an agent's environment has none.
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    scenario, work = sys.argv[1], Path(sys.argv[2])
    uid = int(sys.argv[3]) if len(sys.argv) > 3 else None
    if uid is not None:  # the names a launcher gives a job's user (worker.sandbox._prepare)
        os.environ["USER"] = os.environ["LOGNAME"] = JobUser(uid=uid, gid=uid).name
    os.chdir(work)
    print(json.dumps(globals()[scenario](work, uid)))


if __name__ == "__main__":
    main()
