"""torch's dynamic rendezvous, kept at the controller: the launcher's backend and store.

The launcher registers the rendezvous backend ``relaunch`` (``register``) before
torch's launcher starts; ``--rdzv-endpoint`` is then the controller's URL and
``--rdzv-id`` the attempt's rendezvous id. Both halves speak HTTP to
``/api/v1/rendezvous/{rdzv_id}`` (``contract.rendezvous``) with the node's own
token, which the launcher reads from a file the node agent wrote
(``--node-token-file``): never from the environment, which workers inherit.

- ``ControllerBackend`` is torch's ``RendezvousBackend``: the state blob with
  compare-and-set on its version. The controller never reads the blob.
- ``ControllerStore`` is a ``torch.distributed.Store``: what the elastic agent
  reads and writes beside the state (the master address, ranks, the exit
  barrier), under torch's ``PrefixStore``. A read that must wait asks the
  controller to wait (at most ``MAX_WAIT_S`` per call) and asks again until the
  store's timeout. ``delete_key`` and ``num_keys`` answer when called on it
  directly; torch's ``PrefixStore`` does not pass them on to a Python store.

The endpoint may name several controllers of one database, separated by commas
(``worker.failover``): a call one of them leaves unanswered goes to the next.
A controller that does not answer, or answers 5xx, is asked again with back-off
for up to ``RETRY_S`` (meanwhile torch's agent waits; its workers train on); then
the backend raises ``RendezvousConnectionError`` and the store ``DistStoreError``.
A refusal (401/403/404: the node is no longer a member of the attempt, or the
attempt is over) is raised at once.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import httpx
import torch.distributed as dist
from pydantic import BaseModel, ValidationError
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    create_handler,
)

from contract.rendezvous import (
    MAX_WAIT_S,
    MEMBER_HEADER,
    RENDEZVOUS_PATH,
    RendezvousState,
    SetRendezvousState,
    StoreAdd,
    StoreCompareSet,
    StoreCount,
    StoreDeleted,
    StoreGet,
    StoreItem,
    StoreKey,
    StoreSet,
    StoreValue,
    StoreValues,
    decode,
    encode,
)
from worker.failover import CONNECT_TIMEOUT_S, controller_transport, controller_urls

logger = logging.getLogger(__name__)

BACKEND_NAME = "relaunch"
MIN_SYNC_S = 0.2  # the least time between two rendezvous syncs of a waiting launcher
RETRY_S = 60.0  # how long an unanswered call is retried before it fails (a controller restart)
HTTP_TIMEOUT_S = MAX_WAIT_S + 10.0
_RETRY_STATUS = frozenset({500, 502, 503, 504})
_M = TypeVar("_M", bound=BaseModel)


class RendezvousRefused(Exception):
    """The controller refused the call (4xx): no retry can help."""


class RendezvousUnreachable(Exception):
    """The controller did not answer usefully within ``RETRY_S``."""


class ControllerRendezvous:
    """HTTP calls to one attempt's rendezvous at the controller; thread-safe."""

    def __init__(
        self,
        controller_url: str,
        rdzv_id: str,
        node_token: str,
        *,
        member_id: int | None = None,
        retry_s: float = RETRY_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not rdzv_id:
            raise ValueError("the rendezvous id must not be empty")
        self.rdzv_id = rdzv_id
        self._retry_s = retry_s
        urls = controller_urls(controller_url)
        self._http = httpx.Client(
            base_url=f"{urls[0]}{RENDEZVOUS_PATH}/{rdzv_id}",
            timeout=httpx.Timeout(HTTP_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
            headers={
                "authorization": f"Bearer {node_token}",
                **({} if member_id is None else {MEMBER_HEADER: str(member_id)}),
            },
            transport=controller_transport(urls, transport),
        )

    def close(self) -> None:
        self._http.close()

    def call(
        self,
        method: str,
        path: str,
        body: BaseModel | None,
        reply_type: type[_M],
        params: dict[str, Any] | None = None,
    ) -> _M:
        """One call, retried while the controller is unreachable or overloaded."""
        deadline = time.monotonic() + self._retry_s
        delay = 0.1
        while True:
            try:
                response = self._http.request(
                    method,
                    path,
                    params=params,
                    content=None if body is None else body.model_dump_json(),
                    headers={"content-type": "application/json"},
                )
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code not in _RETRY_STATUS:
                    return _read(method, path, response, reply_type)
                problem = f"HTTP {response.status_code} {response.text[:200]}"
            if time.monotonic() + delay > deadline:
                raise RendezvousUnreachable(
                    f"{method} {path} of rendezvous {self.rdzv_id}: {problem}"
                )
            logger.warning(
                "rendezvous %s: %s %s: %s; retrying", self.rdzv_id, method, path, problem
            )
            time.sleep(delay)
            delay = min(2 * delay, 2.0)


def _read(method: str, path: str, response: httpx.Response, reply_type: type[_M]) -> _M:
    if response.is_error:
        raise RendezvousRefused(f"{method} {path}: {response.status_code} {response.text[:300]}")
    try:
        return reply_type.model_validate_json(response.content)
    except ValidationError as exc:
        raise RendezvousRefused(f"{method} {path}: unexpected reply: {exc}") from exc


class ControllerBackend(RendezvousBackend):
    """The rendezvous state at the controller; the fencing token is its version.

    ``wait_for_change`` waits for another version than the last one this backend
    saw, at the controller (a long poll), so that a launcher waiting for the others
    in a rendezvous goes on as soon as they have written, not at its next poll."""

    def __init__(self, api: ControllerRendezvous) -> None:
        self._api = api
        self._seen: int | None = None
        self.members: int | None = None  # the attempt's active members, as last told
        self._woke = 0.0  # when wait_for_change last returned

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Any] | None:
        return self._decoded(self._call("GET", None))

    def set_state(self, state: bytes, token: Any | None = None) -> tuple[bytes, Any, bool] | None:
        if token is not None and not isinstance(token, int):
            raise RendezvousStateError(f"not a token of this backend: {token!r}")
        reply = self._call("POST", SetRendezvousState(state=encode(state), version=token))
        found = self._decoded(reply)
        return None if found is None else (*found, reply.written)

    def wait_for_change(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the stored state to change; whether it did.

        At most one early wake per ``MIN_SYNC_S``: every other node's keep-alive moves
        the version too, and a large rendezvous must not turn into a storm of syncs."""
        started = time.monotonic()
        rest = MIN_SYNC_S - (started - self._woke)
        if rest > 0:
            time.sleep(rest)
        seen = self._seen
        changed = False
        if seen is not None:
            params = {"changed_from": seen, "wait_s": timeout_s}
            try:
                reply = self._api.call("GET", "/state", None, RendezvousState, params=params)
                changed = reply.version != seen
            except (RendezvousRefused, RendezvousUnreachable):
                pass  # the next sync says so, as torch expects
        left = timeout_s - (time.monotonic() - started)
        if not changed and left > 0:
            time.sleep(left)  # never poll faster than torch would
        self._woke = time.monotonic()
        return changed

    def _call(self, method: str, body: BaseModel | None) -> RendezvousState:
        try:
            reply = self._api.call(method, "/state", body, RendezvousState)
        except (RendezvousRefused, RendezvousUnreachable) as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        self._seen = reply.version
        if reply.members is not None:
            self.members = reply.members
        return reply

    @staticmethod
    def _decoded(reply: RendezvousState) -> tuple[bytes, int] | None:
        if reply.state is None:
            return None
        return decode(reply.state), reply.version


# torch's dynamic rendezvous polls the state once a second while it waits for other
# nodes (``dynamic_rendezvous._delay(seconds=1)`` after a SYNC action, and a state
# cached for a second); this launcher's one handler waits at the controller instead.
_SYNC_DELAY_S = 1
_waiting: DynamicRendezvousHandler | None = None


def _sync_delay(original: Callable[..., None], seconds: Any) -> None:
    handler = _waiting
    backend = getattr(handler, "_backend_for_wait", None)
    if seconds != _SYNC_DELAY_S or handler is None or backend is None:
        original(seconds=seconds)
        return
    if backend.wait_for_change(float(seconds)):
        holder = getattr(handler, "_state_holder", None)
        if holder is not None and hasattr(holder, "_last_sync_time"):
            holder._last_sync_time = -1  # the cached state is stale: read it at once


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _complete_when_all_members_joined(executor: Any, original: Callable[[Any], None]) -> None:
    original(executor)
    state = getattr(executor, "_state", None)
    settings = getattr(executor, "_settings", None)
    backend = getattr(getattr(executor, "_state_holder", None), "_backend", None)
    if state is None or settings is None or not isinstance(backend, ControllerBackend):
        return
    members = backend.members
    # Only participants that still beat: one that joined and died since is not counted.
    fresh_after = datetime.now(UTC) - 2 * settings.keep_alive_interval
    beats = getattr(state, "last_heartbeats", {})
    joined = sum(
        1 for node in state.participants if node in beats and _aware(beats[node]) >= fresh_after
    )
    if (
        not state.complete
        and members is not None
        and joined >= max(members, settings.min_nodes)
        and joined < settings.max_nodes  # at MAX torch has completed the round itself
    ):
        logger.info(
            "rendezvous %s: all %d members of the attempt have joined; not waiting for "
            "the last call",
            settings.run_id,
            joined,
        )
        executor._mark_rendezvous_complete()


def install_sync_wait() -> None:
    """Replace the SYNC poll of torch's dynamic rendezvous in this process, and complete
    a round once the attempt's every member has joined (once per process).

    Seam (torch 2.11 to 2.13, ``rendezvous/dynamic_rendezvous.py``):
    ``_DistributedRendezvousOpExecutor.run`` calls the module's ``_delay(seconds=1)``
    when the state holder has nothing to do but wait for other nodes' writes, and
    ``_BackendRendezvousStateHolder.sync`` serves a state read less than
    ``_cache_duration`` (1 s) ago from ``_last_sync_time``. Any other delay (the
    first round's random skew) is torch's own."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    current = getattr(dynamic_rendezvous, "_delay", None)
    if current is None or getattr(current, "_relaunch_sync_wait", False):
        return  # a torch without the seam, or installed already: torch's own waits
    replacement = functools.partial(_sync_delay, current)
    replacement._relaunch_sync_wait = True  # type: ignore[attr-defined]
    dynamic_rendezvous._delay = replacement
    # ``_add_to_participants`` adds this node to the round and, below MAX, starts the
    # last call; the round is complete at once when every member has joined.
    executor = getattr(dynamic_rendezvous, "_DistributedRendezvousOpExecutor", None)
    add = getattr(executor, "_add_to_participants", None)
    if executor is not None and add is not None:
        executor._add_to_participants = functools.partialmethod(
            _complete_when_all_members_joined, add
        )


class ControllerStore(dist.Store):
    """torch's key/value store for one attempt, kept at the controller."""

    def __init__(self, api: ControllerRendezvous, timeout: timedelta | None = None) -> None:
        super().__init__()
        self._api = api
        if timeout is not None:
            self.set_timeout(timeout)

    def set(self, key: str, value: bytes | str) -> None:
        self.multi_set([key], [value])

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        items = [
            StoreItem(key=k, value=encode(_bytes(v))) for k, v in zip(keys, values, strict=True)
        ]
        self._call("POST", "/store/set", StoreSet(items=items), StoreCount)

    @property
    def _timeout(self) -> timedelta:
        """The base class's timeout (``set_timeout``), which torch's stubs do not declare."""
        timeout: timedelta = getattr(self, "timeout")  # noqa: B009
        return timeout

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        found = self._await(keys, self._timeout, with_values=True)
        return [decode(found.values[k]) for k in keys]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._await(keys, self._timeout if timeout is None else timeout, with_values=False)

    def check(self, keys: list[str]) -> bool:
        body = StoreGet(keys=keys, wait_s=0, with_values=False)
        return self._call("POST", "/store/get", body, StoreValues).complete

    def add(self, key: str, value: int) -> int:
        return self._call("POST", "/store/add", StoreAdd(key=key, amount=value), StoreCount).value

    def compare_set(
        self, key: str, expected_value: bytes | str, desired_value: bytes | str
    ) -> bytes:
        body = StoreCompareSet(
            key=key, expected=encode(_bytes(expected_value)), desired=encode(_bytes(desired_value))
        )
        return decode(self._call("POST", "/store/compare_set", body, StoreValue).value)

    def delete_key(self, key: str) -> bool:
        return self._call("POST", "/store/delete_key", StoreKey(key=key), StoreDeleted).deleted

    def num_keys(self) -> int:
        return self._call("GET", "/store/num_keys", None, StoreCount).value

    def _await(self, keys: list[str], timeout: timedelta, *, with_values: bool) -> StoreValues:
        """Every key's value, waiting for all of them up to ``timeout``."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            left = max(0.0, deadline - time.monotonic())
            body = StoreGet(keys=keys, wait_s=min(left, MAX_WAIT_S), with_values=with_values)
            found = self._call("POST", "/store/get", body, StoreValues)
            if found.complete:
                return found
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(
                    f"wait timeout after {timeout.total_seconds():g} s for keys {keys} "
                    f"of rendezvous {self._api.rdzv_id}"
                )

    def _call(self, method: str, path: str, body: BaseModel | None, reply_type: type[_M]) -> _M:
        try:
            return self._api.call(method, path, body, reply_type)
        except (RendezvousRefused, RendezvousUnreachable) as exc:
            raise dist.DistStoreError(str(exc)) from exc


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def read_token_file(path: Path) -> str:
    """The node's token from the file the agent wrote, which is then removed: the
    workers, started later, cannot read it even when they run as the agent's user.
    ``ValueError`` if it is empty."""
    token = path.read_text().strip()
    path.unlink()
    if not token:
        raise ValueError(f"{path} holds no token")
    return token


def handler_for(
    params: RendezvousParameters, node_token: str, member_id: int | None = None
) -> DynamicRendezvousHandler:
    """torch's dynamic rendezvous for ``params`` (``endpoint``: the controller's URL,
    ``run_id``: the attempt's rendezvous id), kept at the controller; calls carry
    ``member_id``, the membership the launcher runs for, when known."""
    api = ControllerRendezvous(params.endpoint, params.run_id, node_token, member_id=member_id)
    read_timeout = params.get_as_int("read_timeout", 60) or 60
    store = ControllerStore(api, timeout=timedelta(seconds=read_timeout))
    backend = ControllerBackend(api)
    handler = create_handler(store, backend, params)
    handler._backend_for_wait = backend  # type: ignore[attr-defined]
    global _waiting
    _waiting = handler
    install_sync_wait()
    return handler


def register(node_token: str, member_id: int | None = None) -> None:
    """Make ``--rdzv-backend relaunch`` build its handler with ``handler_for``, calling the
    controller with ``node_token`` for membership ``member_id``. Once per process, before
    torch's launcher runs."""
    rendezvous_handler_registry.register(
        BACKEND_NAME, functools.partial(handler_for, node_token=node_token, member_id=member_id)
    )
