"""The warm zygote: a process that has imported torch once and forks each worker from there.

Usage (the launcher starts it; see ``worker.warm``)::

    python -u -m worker.zygote --fd N --parent-pid P

It is started the way a worker is (``python -u -m ...``, the worker's user, the
job's environment without the per-worker variables, the working directory), so
everything that takes effect only when an interpreter starts (``LD_PRELOAD``,
``PYTHONPATH``, ``PYTHONHASHSEED``, a planted package in the working directory)
is in effect in it exactly as in a worker started cold. It imports torch,
``torch.distributed``, ``torch._dynamo``, DDP, numpy and relaunch's runtime,
checks that it is still the only thread and that CUDA is not initialised, says
``ready`` on its socket and waits.

The protocol is JSON, one message per ``SOCK_SEQPACKET`` packet:

- launcher -> zygote: ``{"fork": id, "argv": [...], "env": {...}, "cwd": "...",
  "new_session": bool, "stdout": bool, "stderr": bool}`` with the worker's
  output files as ``SCM_RIGHTS`` descriptors (stdout first);
- zygote -> launcher: ``{"ready": pid, "import_s": s}``, ``{"forked": id, "pid": p}``
  or ``{"refused": id, "reason": "..."}``, and ``{"exited": pid, "returncode": r}``
  (``subprocess.Popen``'s convention: ``-N`` for signal N) for every worker it reaps.

A spare zygote (``--spare``, ``worker.spare`` starts one beside each spare launcher)
is started before any job, as root, with no job's variables, in a root-only
directory. Once loaded it says ``{"loaded": pid, "import_s": s}`` and waits for one
``{"adopt": {"uid", "gid", "env", "cwd", "nice"}}``: it drops to the job's user
first (``adopt``), and only then takes the job's environment and working directory,
puts right what its imports computed from root's (``_recompute_user_state``), and
checks that a cold start as that user would have imported the same modules
(``adoption_refusal``). Then it says ``ready`` (or ``refused`` and exits) and serves
as any zygote. What a job can set that acts only when an interpreter starts is the
launcher's to refuse before it asks (``worker.warm.spare_refusal``).

In the child of a fork, ``serve`` returns the request and ``main`` turns the
process into the worker (``become``): a new session, the output files on 1 and 2,
every other descriptor closed, the worker's environment and working directory,
fresh random state, then ``worker.bootstrap`` with the worker's arguments, and
the interpreter's own exit (``atexit``, non-daemon threads, flushed streams).

Nothing here trusts the launcher less than a cold start does, and the launcher
trusts nothing the zygote says: it checks every pid it is given (``worker.warm``).
"""

from __future__ import annotations

import argparse
import array
import contextlib
import json
import os
import selectors
import signal
import socket
import stat
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from contract.labels import ZYGOTE_PROCESS_NAME
from contract.prctl import set_parent_death_signal, set_process_name

# A request carries a worker's whole environment; a packet stays below this.
MAX_MESSAGE_BYTES = 1 << 20
# What a worker started by ``-m worker.bootstrap`` runs; anything else is refused.
BOOTSTRAP = ("-m", "worker.bootstrap")
# Thread pools that libgomp and MKL size when torch is loaded: a worker whose
# environment asks for another size has it set after the fork.
THREAD_COUNT_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# What torch's elastic agent sets per worker, and what is read only when used (not
# when an interpreter or a library starts): a worker may differ from its zygote here.
PER_WORKER_VARIABLES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES",  # read when CUDA initialises, never in the zygote
        "CUDA_DEVICE_ORDER",
        "OMP_NUM_THREADS",  # set in the child (worker.zygote)
        "MKL_NUM_THREADS",
    }
)
PER_WORKER_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_", "NCCL_")
# Read by the imports, and read again as the job's user by a spare zygote that adopts a
# job (``worker.zygote._recompute_user_state``).
RECOMPUTED_VARIABLES = frozenset(
    {"HOME", "TMPDIR", "TMP", "TEMP", "USER", "LOGNAME", "LNAME", "USERNAME"}
)


# What libgomp and MKL read when torch was loaded here (a spare's, not its job's).
_THREAD_COUNTS_AT_START = {name: os.environ.get(name) for name in THREAD_COUNT_VARIABLES}
# This process's start: its environment, its working directory, and what ``python -m``
# put first on sys.path.
_ENV_AT_START = dict(os.environ)
_CWD_AT_START = os.getcwd()
_PATH0_AT_START = sys.path[0] if sys.path else None
# Variables that Python code read through ``os.environ`` while ``warm_imports`` ran
# (``EnvironmentReads``): a spare serves no job whose value of one differs from its own.
_read_at_import: frozenset[str] = frozenset()
_listed_at_import = False


class EnvironmentReads:
    """While entered, the names whose value Python code looked up in ``os.environ``
    (``[]``, ``get``, ``in``, ``os.getenv``, and every name of a copy or an ``items()``),
    not names only listed. C code that calls ``getenv`` (libgomp, OpenBLAS, the dynamic
    loader) is not seen: ``worker.warm`` refuses those by name. Torch 2.13's imports here
    look up about 400 names, one by one, and copy nothing whole."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        # Whether the environment was listed or copied: what was then looked up in a copy
        # is not seen, so every variable counts as read.
        self.listed = False
        self._original: Any = None
        self._original_iter: Any = None

    def __enter__(self) -> EnvironmentReads:
        environ_type = type(os.environ)
        original = environ_type.__getitem__
        names = self.names

        def _getitem(mapping: Any, key: Any) -> Any:
            if isinstance(key, str):  # os.environb shares the type; its keys are bytes
                names.add(key)
            return original(mapping, key)

        def _iter(mapping: Any) -> Any:
            self.listed = True
            return original_iter(mapping)

        self._original = original
        original_iter = environ_type.__iter__
        self._original_iter = original_iter
        environ_type.__getitem__ = _getitem  # type: ignore[method-assign]
        environ_type.__iter__ = _iter  # type: ignore[method-assign]
        return self

    def __exit__(self, *_: object) -> None:
        type(os.environ).__getitem__ = self._original  # type: ignore[method-assign]
        type(os.environ).__iter__ = self._original_iter  # type: ignore[method-assign]


# Top-level modules that a cold worker has imported before its script's directory goes
# first on sys.path (what ``worker.bootstrap`` imports first); set by ``warm_imports``.
_before_script: frozenset[str] = frozenset()


def _top_level_modules() -> frozenset[str]:
    return frozenset(name.split(".", 1)[0] for name in list(sys.modules))


def warm_imports() -> None:
    """What every worker would import first: paid once, here; the variables it read."""
    global _read_at_import, _listed_at_import
    with EnvironmentReads() as reads:
        _import_all()
    _read_at_import = frozenset(reads.names)
    _listed_at_import = reads.listed


def _import_all() -> None:
    global _before_script
    # First what the bootstrap imports before it runs the script, as a cold worker does.
    import torch
    import torch.distributed.elastic.multiprocessing.errors

    import worker.bootstrap
    import worker.runtime.startup
    import worker.runtime.step_counter  # noqa: F401

    _before_script = _top_level_modules()
    # Then what a DDP script imports next.
    import numpy  # noqa: F401
    import torch._dynamo  # DDP's constructor imports it: seconds on a CUDA build
    import torch.distributed
    import torch.nn.parallel

    if not torch.distributed.is_available():  # pragma: no cover - builds without it
        raise RuntimeError("this torch has no torch.distributed")


def extra_modules() -> frozenset[str]:
    """Top-level modules the zygote imported beyond what a cold worker has imported by
    the time it runs the script."""
    return _top_level_modules() - _before_script


def threads() -> int:
    """Threads of this process, by the kernel's count."""
    return len(os.listdir("/proc/self/task"))


def fork_refusal() -> str | None:
    """Why forking now would not give a sound worker; None when it would.

    Threads the kernel counts are checked after each fork instead (``_fork``): a
    library may run a pool that it stops itself when the process forks (OpenBLAS,
    which torch loads with numpy, does, through ``pthread_atfork``)."""
    import threading

    if threading.active_count() != 1:
        return f"the zygote runs {threading.active_count()} Python threads"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in the zygote; a forked child could not use it"
    return None


def _module_names(directory: str) -> set[str]:
    """The top-level modules that files in ``directory`` would provide."""
    names = set()
    for entry in os.listdir(directory):
        stem = entry.split(".", 1)[0]
        if entry.endswith((".py", ".pyc", ".so")) or os.path.isdir(os.path.join(directory, entry)):
            names.add(stem)
    return names


def shadow_refusal(request: Request) -> str | None:
    """Why the script's own directory would give this worker another module than the one
    the zygote imported; None if it would not.

    A worker started cold puts the script's directory first on ``sys.path`` once the
    bootstrap has imported torch; a module the zygote imported after that (``sympy``,
    by ``torch._dynamo``) would come from a file of that name beside the script in a
    cold worker, and is already imported in a fork."""
    args = request.argv[len(BOOTSTRAP) :]
    if not args or args[0] == "-m":
        return None  # sys.path[0] is the working directory, as it is in the zygote
    directory = os.path.dirname(os.path.abspath(os.path.join(request.cwd, args[0])))
    try:
        names = _module_names(directory)
    except OSError:
        return None  # not listable: what the worker imports cannot be told, nor changed
    for name in sorted(names & extra_modules()):
        origin = getattr(sys.modules.get(name), "__file__", None) or ""
        if not origin.startswith(directory + os.sep):
            return f"the script's directory holds {name!r}, which the zygote took from elsewhere"
    return None


def _fork() -> tuple[int, str | None]:
    """Fork; in the parent, ``(pid, None)`` if no thread but the forking one existed
    at the fork, else ``(pid, why)`` with the child already ended. The child goes
    on only once the parent has counted (a byte on a pipe); it gets ``(0, None)``."""
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(go_write)
        verdict = os.read(go_read, 1)
        os.close(go_read)
        if verdict != b"1":
            os._exit(70)
        return 0, None
    os.close(go_read)
    count = threads()  # any thread still here now was here at the fork as well
    os.write(go_write, b"1" if count == 1 else b"0")
    os.close(go_write)
    if count == 1:
        return pid, None
    os.waitpid(pid, 0)
    return pid, f"the zygote had {count} threads at the fork; a fork copies only one"


def _trial_fork() -> str | None:
    """Fork once, to learn before serving whether a fork here is sound."""
    pid, refusal = _fork()
    if pid == 0:
        os._exit(0)
    if refusal is None:
        os.waitpid(pid, 0)
    return refusal


@dataclass
class Request:
    """One worker to fork: what the launcher asked, and the descriptors it sent."""

    id: int
    argv: list[str]
    env: dict[str, str]
    cwd: str
    new_session: bool
    stdout: int | None
    stderr: int | None
    gate: int | None = None  # read by the child: one byte from the launcher, or EOF
    fds: list[int] = field(default_factory=list)

    @classmethod
    def parse(cls, payload: bytes, fds: list[int]) -> Request:
        message = json.loads(payload)
        argv = message["argv"]
        env = message["env"]
        if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
            raise ValueError("argv must be a list of strings")
        if not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
            raise ValueError("env must map names to strings")
        if any("=" in k or "\x00" in k or "\x00" in v or not k for k, v in env.items()):
            raise ValueError("env holds a name or value that no environment can")
        flags = [bool(message.get(name)) for name in ("stdout", "stderr", "gate")]
        if sum(flags) != len(fds):
            raise ValueError(f"{sum(flags)} descriptors announced, {len(fds)} sent")
        queue = list(fds)
        stdout, stderr, gate = (queue.pop(0) if flag else None for flag in flags)
        return cls(
            id=int(message["fork"]),
            argv=argv,
            env=env,
            cwd=str(message["cwd"]),
            new_session=bool(message.get("new_session", True)),
            stdout=stdout,
            stderr=stderr,
            gate=gate,
            fds=list(fds),
        )


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


def _receive(sock: socket.socket) -> tuple[bytes, list[int]]:
    fds = array.array("i")
    payload, ancillary, _flags, _addr = sock.recvmsg(
        MAX_MESSAGE_BYTES, socket.CMSG_SPACE(3 * fds.itemsize), socket.MSG_CMSG_CLOEXEC
    )
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    return payload, list(fds)


def _pass_gate(request: Request) -> None:
    """In the child: wait for the launcher's word (it has checked and registered this
    process); without it (EOF: it gave up on this fork), end before becoming anything."""
    if request.gate is None:
        return
    try:
        word = os.read(request.gate, 1)
    except OSError:
        word = b""
    if word != b"1":
        os._exit(70)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})


def serve(sock: socket.socket) -> Request:
    """Fork a worker for each request until the launcher hangs up (then exit).

    Returns only in a forked child, with the request it is to become."""
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_read:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_read, 4096)
                _reap(sock)
                continue
            payload, fds = _receive(sock)
            if not payload:
                os._exit(0)  # the launcher is gone; its workers are its agent's to end
            try:
                request = Request.parse(payload, fds)
            except (ValueError, KeyError, TypeError) as exc:
                for fd in fds:
                    os.close(fd)
                _send(sock, {"refused": -1, "reason": f"bad request: {exc}"})
                continue
            refusal = fork_refusal() or shadow_refusal(request)
            if refusal is not None:
                for fd in fds:
                    os.close(fd)
                _send(sock, {"refused": request.id, "reason": refusal})
                continue
            pid, refusal = _fork()
            if refusal is not None:
                for fd in fds:
                    os.close(fd)
                _send(sock, {"refused": request.id, "reason": refusal})
                continue
            if pid == 0:
                selector.close()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_read)
                os.close(wake_write)
                sock.close()
                return request
            for fd in fds:
                os.close(fd)
            # A pidfd, taken before this child can be reaped: it names this process
            # whatever happens to its pid, and the launcher signals it through it.
            pidfd = os.pidfd_open(pid)
            try:
                payload = json.dumps({"forked": request.id, "pid": pid}).encode()
                rights = array.array("i", [pidfd])
                sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
            finally:
                os.close(pidfd)
            _reap(sock)


def _redirect(request: Request) -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if request.stdout is not None:
        os.dup2(request.stdout, 1)
    if request.stderr is not None:
        os.dup2(request.stderr, 2)
    # As Popen(close_fds=True): the worker holds 0, 1 and 2 only.
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))


def _apply_thread_counts(before: dict[str, str | None]) -> None:
    """Give torch the thread pool size the worker's environment asks for, where it
    differs from the zygote's (libgomp read it when torch was loaded)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    for name in THREAD_COUNT_VARIABLES:
        value = os.environ.get(name)
        if value == before.get(name) or value is None:
            continue
        with contextlib.suppress(ValueError):
            count = int(value)
            if count > 0:
                torch.set_num_threads(count)
                return


def _reseed() -> None:
    """``random`` reseeds itself at fork; numpy's global generator does not."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def become(request: Request) -> list[str]:
    """Turn this forked child into the worker; returns the bootstrap's arguments."""
    _pass_gate(request)
    set_process_name(os.path.basename(sys.executable))  # as exec would have named it
    if request.new_session:
        os.setsid()
    _redirect(request)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    _recompute_compile_cache()
    _apply_thread_counts(_THREAD_COUNTS_AT_START)
    _reseed()
    return request.argv[len(BOOTSTRAP) :]


PR_SET_DUMPABLE = 4


@dataclass(frozen=True)
class Adoption:
    """What makes a spare zygote one job's: its user (None: keep this one), environment,
    working directory and scheduling priority (None: keep this one)."""

    uid: int | None
    gid: int | None
    env: dict[str, str]
    cwd: str
    nice: int | None

    @classmethod
    def parse(cls, payload: bytes) -> Adoption:
        message = json.loads(payload)
        body = message["adopt"]
        uid, gid, nice = body.get("uid"), body.get("gid"), body.get("nice")
        env, cwd = body["env"], body["cwd"]
        if (uid is None) != (gid is None):
            raise ValueError("uid and gid come together")
        for name, value in (("uid", uid), ("gid", gid), ("nice", nice)):
            if value is not None and (type(value) is not int or (name != "nice" and value <= 0)):
                raise ValueError(f"{name} must be a positive integer")
        if not isinstance(cwd, str) or not os.path.isabs(cwd):
            raise ValueError("cwd must be an absolute path")
        if not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
            raise ValueError("env must map names to strings")
        if any("=" in k or "\x00" in k or "\x00" in v or not k for k, v in env.items()):
            raise ValueError("env holds a name or value that no environment can")
        return cls(uid=uid, gid=gid, env=env, cwd=cwd, nice=nice)


def _set_dumpable() -> None:
    """A process that changed its uids is not dumpable, so its own user could not read its
    /proc files, trace it or get its core; a worker exec'd as that user is. Made so again
    once nothing of root's is left in it."""
    import ctypes

    # This process's own symbols (libc's among them): no ldconfig, no temporary file.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_DUMPABLE): {os.strerror(err)}")


def _drop_to(uid: int, gid: int) -> None:
    """Become ``uid``/``gid`` with no supplementary groups, for good (real, effective and
    saved ids, so no way back); ``PermissionError`` if that is not what the kernel says."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
        raise PermissionError(f"could not drop to uid {uid}, gid {gid}")
    _set_dumpable()


def _recompute_user_state() -> str | None:
    """What the imports computed from the user, HOME, TMPDIR and the working directory,
    computed again as the job's user in the job's environment, as a cold start has it.

    The state that differs (compared by ``tests/worker/test_warm.py``): ``sys.path[0]``
    (the working directory under ``python -m``), ``tempfile.tempdir``, the user site
    (``site.USER_BASE``/``USER_SITE``, sysconfig's ``userbase``), and torch's compile
    cache directory (``TORCHINDUCTOR_CACHE_DIR``, made by ``torch._dynamo``'s import and
    kept by its ``DynamoCache``)."""
    import site
    import sysconfig
    import tempfile

    if sys.path and sys.path[0] == _PATH0_AT_START and not getattr(sys.flags, "safe_path", 0):
        sys.path[0] = os.getcwd()
    refusal = _rebase(_CWD_AT_START, os.getcwd())
    if refusal is not None:
        return refusal
    tempfile.tempdir = None
    tempfile.gettempdir()
    site.USER_BASE = None
    site.USER_SITE = None
    site.getusersitepackages()
    config = sysconfig.get_config_vars()
    if "userbase" in config:
        config["userbase"] = site.USER_BASE
    _recompute_compile_cache()
    return None


def _rebase(old: str, new: str) -> str | None:
    """Paths the imports computed from the working directory ``old`` (``abspath(getcwd())``
    in multiprocessing, ``realpath("")`` and ``getcwd()`` joins in torch's configs), made
    ``new``'s: module-level strings, and the defaults of torch's config modules (so they
    stay defaults, not overrides). ``old`` is a directory of the spare's own, which no
    other path of the imports' lies in."""
    prefix = os.path.join(old, "")

    def moved(value: object) -> str | None:
        if not isinstance(value, str):
            return None
        if value == old:
            return new
        return os.path.join(new, value[len(prefix) :]) if value.startswith(prefix) else None

    config_type = getattr(sys.modules.get("torch.utils._config_module"), "ConfigModule", None)
    for name, module in list(sys.modules.items()):
        if module is None:
            continue
        try:
            is_config = config_type is not None and isinstance(module, config_type)
            for key, value in list(vars(module).items()):
                rebased = moved(value)
                if rebased is not None and not (is_config and key in vars(module)["_config"]):
                    module.__dict__[key] = rebased
            if is_config:
                _rebase_config(module, moved)
        except Exception as exc:  # any failure is a refusal, never a half-made zygote
            return f"cannot move {name}'s paths from the spare's directory: {exc!r:.200}"
    return None


def _rebase_config(module: Any, moved: Any) -> None:
    """A torch config module's defaults that ``moved`` maps, changed as defaults (not as
    overrides), and its caches of them marked stale."""
    from contextvars import ContextVar

    changed = False
    for entry in module._config.values():
        rebased = moved(getattr(entry, "default", None))
        if rebased is not None:
            entry.default = rebased
            changed = True
    if changed:
        for name, stale in (("_hash_dirty_var", True), ("_get_dict_dirty_keys_var", None)):
            var = getattr(module, name, None)
            if isinstance(var, ContextVar):
                var.set(stale)
        if hasattr(module, "_is_dirty"):
            module._is_dirty = True


def _recompute_compile_cache() -> None:
    """torch's compile cache directory as importing ``torch._dynamo`` here, now, would
    make it: from ``TORCHINDUCTOR_CACHE_DIR``, else the user and the temp directory; set in
    ``os.environ`` and made if missing (torch 2.13's ``torch._dynamo.package``; nothing
    where a torch has no such module)."""
    package = sys.modules.get("torch._dynamo.package")
    cache = getattr(package, "DynamoCache", None)
    if package is not None and hasattr(cache, "_path_prefix") and hasattr(package, "cache_dir"):
        cache._path_prefix = os.path.join(package.cache_dir(), "dynamo")  # type: ignore[union-attr]


def adoption_refusal(cwd: str) -> str | None:
    """Why this zygote, loaded elsewhere, is not what a cold start in ``cwd`` as this
    user would be; None if it is. Checked with the job's permissions.

    A cold zygote has ``cwd`` first on ``sys.path`` and the user's site-packages after
    the system's (when they exist): a module there would have been imported in place of
    the one loaded here."""
    import site

    if site.ENABLE_USER_SITE and site.USER_SITE and os.path.isdir(site.USER_SITE):
        return f"the job's user site-packages ({site.USER_SITE}) would be on a cold sys.path"

    try:
        names = _module_names(cwd)
    except OSError as exc:
        return f"cannot list the working directory {cwd} as the job's user: {exc.strerror}"
    for name in sorted(names & _top_level_modules()):
        origin = getattr(sys.modules.get(name), "__file__", None) or ""
        if origin and not origin.startswith(os.path.join(cwd, "")):
            return f"the working directory holds {name!r}, which the spare took from elsewhere"
    return None


def _held_beyond(sock_fd: int) -> list[str]:
    """The descriptors this process holds besides 0, 1, 2 and ``sock_fd``: anything root
    opened and kept would be the job's to use once it runs here."""
    held = []
    for entry in os.listdir("/proc/self/fd"):
        fd = int(entry)
        if fd == sock_fd:
            continue
        if fd in (0, 1, 2):
            with contextlib.suppress(OSError):  # streams: a pipe or a device, never a file
                mode = os.fstat(fd).st_mode
                if not (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
                    held.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
            continue
        try:
            held.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            continue  # the listing's own, closed by now
    return held


def import_read_refusal(job_env: dict[str, str]) -> str | None:
    """Why a job with ``job_env`` cannot adopt this spare: its value of a variable that
    the spare's imports read differs; None if none does. What is set per worker, and
    what adoption computes again, may differ."""
    names = set(job_env) | set(_ENV_AT_START) if _listed_at_import else _read_at_import
    for name in sorted(names - RECOMPUTED_VARIABLES):
        if name in PER_WORKER_VARIABLES or name.startswith(PER_WORKER_PREFIXES):
            continue
        if job_env.get(name) != _ENV_AT_START.get(name):
            return f"the job's {name} differs from the spare's, which its imports read"
    return None


def adopt(adoption: Adoption, sock_fd: int) -> str | None:
    """Become the zygote a cold start of this job would have been; why not, or None.

    The order is the point: the priority is set while root may still raise it, the
    user is dropped next, and only then is anything of the job's taken (its working
    directory, entered with its permissions; its environment). A refusal leaves a
    process that can serve no one: the caller ends it."""
    refusal = import_read_refusal(adoption.env)
    if refusal is not None:
        return refusal
    if adoption.nice is not None:
        with contextlib.suppress(PermissionError):  # not root: never made lower, keep it
            os.setpriority(os.PRIO_PROCESS, 0, adoption.nice)
    held = _held_beyond(sock_fd)
    if held:
        return f"the spare holds more than its socket and standard streams: {held}"
    if threads() != 1:
        return f"the spare runs {threads()} threads; only one drops its user with certainty"
    if adoption.uid is not None and adoption.gid is not None:
        _drop_to(adoption.uid, adoption.gid)
    try:
        os.chdir(adoption.cwd)
    except OSError as exc:
        return f"cannot enter {adoption.cwd} as the job's user: {exc.strerror}"
    os.environ.clear()
    os.environ.update(adoption.env)
    return _recompute_user_state() or adoption_refusal(os.getcwd())


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m worker.zygote")
    parser.add_argument("--fd", type=int, required=True, help="the socket to the launcher")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument(
        "--spare", action="store_true", help="load, then wait to be adopted by one job"
    )
    return parser.parse_args(list(argv))


def _await_adoption(sock: socket.socket, import_s: float) -> None:
    """A spare's wait: say it has loaded, take one adoption, adopt or exit."""
    _send(sock, {"loaded": os.getpid(), "import_s": import_s})
    payload, fds = _receive(sock)
    for fd in fds:
        os.close(fd)
    if not payload:
        sys.exit(0)  # its launcher is gone, or gave it up
    try:
        refusal = adopt(Adoption.parse(payload), sock.fileno())
    except (ValueError, KeyError, TypeError, OSError) as exc:
        refusal = f"bad adoption: {exc}"
    refusal = refusal or fork_refusal()
    if refusal is not None:
        _send(sock, {"refused": 0, "reason": refusal})
        sys.exit(1)


def main(argv: Sequence[str] | None = None) -> None:
    ns = _parse(sys.argv[1:] if argv is None else argv)
    # The launcher's death ends the zygote through its socket (EOF), not its workers:
    # those are the agent's. (No parent-death signal: a replacement zygote is started by
    # a launcher thread that ends soon after, and the signal follows the thread.)
    set_process_name(ZYGOTE_PROCESS_NAME)
    if ns.spare:
        # A spare's launcher starts it from the thread that lives as long as it does; a
        # root spare must not outlive it. The kernel clears the signal at the drop to the
        # job's user: from then on the launcher's end reaches it as EOF, as any zygote.
        set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != ns.parent_pid:
        sys.exit(1)
    sock = socket.socket(fileno=ns.fd)
    started = time.monotonic()
    warm_imports()
    refusal = fork_refusal() or _trial_fork()
    if refusal is not None:
        print(f"relaunch zygote: not serving: {refusal}", file=sys.stderr)
        sys.exit(1)
    import_s = round(time.monotonic() - started, 3)
    if ns.spare:
        _await_adoption(sock, import_s)
    _send(sock, {"ready": os.getpid(), "import_s": import_s, "spare": ns.spare})
    request = serve(sock)
    sys.argv = [sys.modules["worker.bootstrap"].__file__ or "", *become(request)]
    from worker import bootstrap

    bootstrap.main()


if __name__ == "__main__":
    main()
