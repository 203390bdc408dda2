"""The Python API of relaunch: submit jobs, wait for them, follow their logs and metrics.

``RelaunchClient`` calls the controller's REST API as the user whose token it holds. It
needs only httpx, PyYAML and pydantic: importing it loads no FastAPI, SQLAlchemy or torch,
so it runs anywhere a job is submitted from.

Every error it raises is a ``RelaunchError``: ``ApiError`` when the controller answered
with an error, ``ControllerUnreachable`` when it did not answer at all, ``WaitTimeout`` and
``JobEnded`` from ``wait``, ``SpecFileError`` when a spec file cannot be read.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from contract.protocol import DEFAULT_CONTROLLER_URL
from service.states import TERMINAL_JOB_STATES, JobState

URL_ENV = "RELAUNCH_URL"
TOKEN_ENV = "RELAUNCH_TOKEN"
TERMINAL_STATES = frozenset(str(state) for state in TERMINAL_JOB_STATES)
JobSpecSource = dict[str, Any] | str | Path


class RelaunchError(Exception):
    """Anything the client raises on purpose."""


class ApiError(RelaunchError):
    """The controller answered with an error: ``status_code`` and its ``message``."""

    def __init__(self, status_code: int, detail: Any) -> None:
        self.status_code = status_code
        self.detail = detail
        self.message = format_detail(detail)
        super().__init__(f"HTTP {status_code}: {self.message}")


class ControllerUnreachable(RelaunchError):
    """No answer from the controller at ``url``: refused, timed out, or not a usable URL.

    ``str()`` says why and what to check; ``describe(where)`` says it with another hint on
    where the URL is set (the CLI names its ``--url``).
    """

    def __init__(self, url: str, cause: Exception, timeout_s: float) -> None:
        self.url = url
        self.cause = cause
        self.timeout_s = timeout_s
        super().__init__(self.describe(f"set {URL_ENV} or pass url="))

    def describe(self, where: str) -> str:
        if isinstance(self.cause, httpx.TimeoutException):
            return (
                f"the controller at {self.url} did not answer within {self.timeout_s:g} s; is "
                f"it up, and is the port open from here? {where}"
            )
        if isinstance(self.cause, httpx.UnsupportedProtocol | httpx.InvalidURL):
            return (
                f"{self.url!r} is not a usable controller URL ({self.cause}); {where} to "
                "http://HOST:PORT"
            )
        reason = re.sub(r"^\[Errno -?\d+\] ", "", str(self.cause)) or type(self.cause).__name__
        return (
            f"cannot reach the controller at {self.url}: {reason[:1].lower()}{reason[1:]}; "
            f"is `relaunch server` running there? {where}"
        )


class WaitTimeout(RelaunchError):
    """``wait`` gave up: the job was not in one of ``states`` after ``timeout_s``.

    ``job`` is the job as last seen.
    """

    def __init__(self, job: dict[str, Any], states: Collection[str], timeout_s: float) -> None:
        self.job = job
        self.states = frozenset(states)
        self.timeout_s = timeout_s
        wanted = ", ".join(sorted(self.states))
        super().__init__(f"job {job['id']} is {job['state']}, not {wanted}, after {timeout_s:g} s")


class JobEnded(RelaunchError):
    """``wait`` gave up: the job ended in a state it was not waiting for, and it never
    leaves an ended state. ``job`` is the job as it ended."""

    def __init__(self, job: dict[str, Any], states: Collection[str]) -> None:
        self.job = job
        self.states = frozenset(states)
        wanted = ", ".join(sorted(self.states))
        super().__init__(f"job {job['id']} ended {job['state']}; it will never be {wanted}")


class SpecFileError(RelaunchError):
    """A job spec file that cannot be read, does not parse, or holds no mapping."""


def format_detail(detail: Any) -> str:
    """Render FastAPI's validation errors as 'field: message' lines."""
    if isinstance(detail, list):
        lines = []
        for err in detail:
            loc = ".".join(str(p) for p in err.get("loc", []) if p != "body")
            lines.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        return "; ".join(lines)
    return str(detail)


def with_scheme(url: str) -> str:
    """``url``, with ``http://`` in front when it names no scheme (``HOST:PORT``)."""
    url = url.strip()
    return url if "://" in url else f"http://{url}"


def load_spec(path: str | Path) -> dict[str, Any]:
    """The job spec in a file: JSON if its name ends in ``.json``, YAML otherwise.

    Raises ``SpecFileError`` if it cannot be read, does not parse, or is not a mapping.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecFileError(f"cannot read {path}: {exc}") from exc
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise SpecFileError(f"{path} is not valid {kind}: {exc}") from exc
    if not isinstance(data, dict):
        raise SpecFileError(f"{path} must hold a mapping (the job spec)")
    return data


def _job_states(states: Collection[str]) -> frozenset[str]:
    known = {str(state) for state in JobState}
    unknown = sorted(set(states) - known)
    if unknown or not states:
        raise ValueError(
            f"not job states: {', '.join(unknown) or '(none given)'}; "
            f"a job is one of {', '.join(sorted(known))}"
        )
    return frozenset(states)


class RelaunchClient:
    """The controller's REST API, called as the user whose token it holds.

    ``url`` defaults to ``RELAUNCH_URL`` (then ``http://127.0.0.1:8080``); ``HOST:PORT``
    alone means ``http://HOST:PORT``. ``token`` defaults to ``RELAUNCH_TOKEN``; without
    one only ``health()`` answers. ``timeout_s`` bounds each request. ``http_client``
    replaces the client's own connection (the caller keeps it and closes it): the tests
    pass FastAPI's ``TestClient`` to call an app in the same process.

    Use it as a context manager, or call ``close()``.
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        timeout_s: float = 10.0,
        *,
        http_client: httpx.Client | None = None,
    ) -> None:
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self.timeout_s = timeout_s
        self._owns_http = http_client is None
        if http_client is not None:
            self.base_url = str(http_client.base_url).rstrip("/")
            self._http = http_client
            return
        self.base_url = with_scheme(url or os.environ.get(URL_ENV) or DEFAULT_CONTROLLER_URL)
        self.base_url = self.base_url.rstrip("/")
        try:
            self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s)
        except httpx.InvalidURL as exc:
            raise ControllerUnreachable(self.base_url, exc, timeout_s) from exc

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> RelaunchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self, method: str, path: str, headers: dict[str, str] | None = None, **kwargs: Any
    ) -> Any:
        try:
            response = self._http.request(
                method, path, headers={**self._headers, **(headers or {})}, **kwargs
            )
        except (httpx.TransportError, httpx.InvalidURL) as exc:
            raise ControllerUnreachable(self.base_url, exc, self.timeout_s) from exc
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except (ValueError, AttributeError):
                detail = response.text
            raise ApiError(response.status_code, detail)
        try:
            return response.json()
        except ValueError:
            raise ApiError(
                response.status_code, "the answer is not JSON: is this a relaunch controller?"
            ) from None

    def _items(self, path: str, **params: Any) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self._call("GET", path, params=params)["items"]
        return items

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/healthz")
        return result

    # Jobs

    def submit(self, spec: JobSpecSource, *, idempotency_key: str | None = None) -> dict[str, Any]:
        """Submit a job; returns it as the controller stored it (``PENDING``).

        ``spec`` is the job spec as a dict, or the path of a YAML or JSON file holding it
        (``SpecFileError`` if that cannot be read). The same ``idempotency_key`` again
        returns the same job instead of a second one. ``ApiError`` (422) names what is
        wrong with a spec the controller refuses.
        """
        body = spec if isinstance(spec, dict) else load_spec(spec)
        headers = {"idempotency-key": idempotency_key} if idempotency_key else {}
        result: dict[str, Any] = self._call("POST", "/api/v1/jobs", json=body, headers=headers)
        return result

    def job(self, job_id: int) -> dict[str, Any]:
        """One job with its spec, state, progress and attempts."""
        result: dict[str, Any] = self._call("GET", f"/api/v1/jobs/{job_id}")
        return result

    def jobs(self, state: str | None = None, limit: int = 50, offset: int = 0) -> dict[str, Any]:
        """A page of the user's jobs, newest first: ``{"items", "total", …}``."""
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if state:
            params["state"] = state
        result: dict[str, Any] = self._call("GET", "/api/v1/jobs", params=params)
        return result

    def cancel(self, job_id: int) -> dict[str, Any]:
        """Cancel a job; cancelling one that has ended changes nothing. Returns the job."""
        result: dict[str, Any] = self._call("POST", f"/api/v1/jobs/{job_id}/cancel")
        return result

    def wait(
        self,
        job_id: int,
        states: Collection[str] = TERMINAL_STATES,
        timeout_s: float | None = None,
        poll_s: float = 1.0,
    ) -> dict[str, Any]:
        """Poll the job every ``poll_s`` until its state is one of ``states`` (by default,
        until it ends); returns the job as then seen.

        Raises ``WaitTimeout`` after ``timeout_s`` (``None``: no limit), ``JobEnded`` if
        it ends in a state not among ``states``, and ``ValueError`` for a name that is
        not a job state.
        """
        wanted = _job_states(states)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if job["state"] in wanted:
                return job
            if job["state"] in TERMINAL_STATES:
                raise JobEnded(job, wanted)
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(job, wanted, timeout_s or 0.0)
            pause = poll_s if deadline is None else min(poll_s, deadline - time.monotonic())
            time.sleep(max(pause, 0.0))

    def events(self, job_id: int, after_id: int = 0, limit: int = 500) -> list[dict[str, Any]]:
        """The job's timeline, oldest first, from the event after ``after_id``."""
        return self._items(f"/api/v1/jobs/{job_id}/events", after_id=after_id, limit=limit)

    def recoveries(self, job_id: int) -> list[dict[str, Any]]:
        """The job's restarts and re-forms with their phases, oldest first."""
        return self._items(f"/api/v1/jobs/{job_id}/recoveries")

    def metrics(self, job_id: int, after_id: int = 0, limit: int = 1000) -> list[dict[str, Any]]:
        """The job's training metrics (step, loss, …), oldest first, after ``after_id``."""
        return self._items(f"/api/v1/jobs/{job_id}/metrics", after_id=after_id, limit=limit)

    def logs(self, job_id: int, after_id: int = 0, limit: int = 1000) -> list[dict[str, Any]]:
        """The job's log lines, oldest first, after ``after_id``."""
        return self._items(f"/api/v1/jobs/{job_id}/logs", after_id=after_id, limit=limit)

    def follow_logs(
        self, job_id: int, *, after_id: int = 0, poll_s: float = 1.0
    ) -> Iterator[dict[str, Any]]:
        """Yield the job's log lines as they arrive, until it has ended and every line
        stored before it ended has been yielded."""
        while True:
            # Read the state first: a line stored before the job ended is then read below.
            ended = self.job(job_id)["state"] in TERMINAL_STATES
            lines = self.logs(job_id, after_id=after_id)
            for line in lines:
                yield line
                after_id = line["id"]
            if lines:
                continue
            if ended:
                return
            time.sleep(poll_s)

    def snapshots(self, job_id: int) -> list[dict[str, Any]]:
        """The job's committed snapshots."""
        return self._items(f"/api/v1/jobs/{job_id}/snapshots")

    # Nodes and users

    def nodes(self, limit: int = 1000) -> list[dict[str, Any]]:
        return self._items("/api/v1/nodes", limit=limit)

    def me(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/api/v1/users/me")
        return result

    def create_user(self, name: str, role: str = "user", **limits: int | None) -> dict[str, Any]:
        body = {"name": name, "role": role, **{k: v for k, v in limits.items() if v is not None}}
        result: dict[str, Any] = self._call("POST", "/api/v1/users", json=body)
        return result

    def users(self, limit: int = 200, offset: int = 0) -> dict[str, Any]:
        params = {"limit": limit, "offset": offset}
        result: dict[str, Any] = self._call("GET", "/api/v1/users", params=params)
        return result

    def create_token(self, user_id: int, label: str = "") -> dict[str, Any]:
        path = f"/api/v1/users/{user_id}/tokens"
        result: dict[str, Any] = self._call("POST", path, json={"label": label})
        return result

    def tokens(self, user_id: int) -> list[dict[str, Any]]:
        return self._items(f"/api/v1/users/{user_id}/tokens")

    def revoke_token(self, token_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/api/v1/tokens/{token_id}/revoke")
        return result

    # Per-node enrolment tokens (admins only)

    def create_enrolment_token(
        self, node_name: str | None = None, expires_in_s: int = 86400, single_use: bool = True
    ) -> dict[str, Any]:
        """A new token a node's agent registers with: ``{"token": ..., "secret": ...}``;
        the secret is in this answer only."""
        body = {"node_name": node_name, "expires_in_s": expires_in_s, "single_use": single_use}
        result: dict[str, Any] = self._call("POST", "/api/v1/enrolment-tokens", json=body)
        return result

    def enrolment_tokens(self) -> list[dict[str, Any]]:
        return self._items("/api/v1/enrolment-tokens")

    def revoke_enrolment_token(self, token_id: int) -> dict[str, Any]:
        path = f"/api/v1/enrolment-tokens/{token_id}/revoke"
        result: dict[str, Any] = self._call("POST", path)
        return result
