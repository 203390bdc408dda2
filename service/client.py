"""A small client of the REST API, used by the CLI, the demo and the tests."""

from __future__ import annotations

from typing import Any

import httpx


class ApiError(RuntimeError):
    """The controller answered with an error; ``str()`` is its message."""

    def __init__(self, status_code: int, detail: Any) -> None:
        self.status_code = status_code
        self.detail = detail
        super().__init__(f"HTTP {status_code}: {format_detail(detail)}")


def format_detail(detail: Any) -> str:
    """Render FastAPI's validation errors as 'field: message' lines."""
    if isinstance(detail, list):
        lines = []
        for err in detail:
            loc = ".".join(str(p) for p in err.get("loc", []) if p != "body")
            lines.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        return "; ".join(lines)
    return str(detail)


class RelaunchClient:
    """Calls the API as the user whose token it holds (``None``: only /healthz answers)."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RelaunchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise ApiError(response.status_code, detail)
        try:
            return response.json()
        except ValueError:
            raise ApiError(
                response.status_code, "the answer is not JSON: is this a relaunch controller?"
            ) from None

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/healthz")
        return result

    def submit(self, spec: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"idempotency-key": idempotency_key} if idempotency_key else {}
        result: dict[str, Any] = self._call("POST", "/api/v1/jobs", json=spec, headers=headers)
        return result

    def job(self, job_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", f"/api/v1/jobs/{job_id}")
        return result

    def jobs(self, state: str | None = None, limit: int = 50, offset: int = 0) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if state:
            params["state"] = state
        result: dict[str, Any] = self._call("GET", "/api/v1/jobs", params=params)
        return result

    def cancel(self, job_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/api/v1/jobs/{job_id}/cancel")
        return result

    def events(self, job_id: int, after_id: int = 0) -> list[dict[str, Any]]:
        body = self._call("GET", f"/api/v1/jobs/{job_id}/events", params={"after_id": after_id})
        items: list[dict[str, Any]] = body["items"]
        return items

    def metrics(self, job_id: int, after_id: int = 0) -> list[dict[str, Any]]:
        body = self._call("GET", f"/api/v1/jobs/{job_id}/metrics", params={"after_id": after_id})
        items: list[dict[str, Any]] = body["items"]
        return items

    def logs(self, job_id: int, after_id: int = 0, limit: int = 1000) -> list[dict[str, Any]]:
        body = self._call(
            "GET", f"/api/v1/jobs/{job_id}/logs", params={"after_id": after_id, "limit": limit}
        )
        items: list[dict[str, Any]] = body["items"]
        return items

    def snapshots(self, job_id: int) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self._call("GET", f"/api/v1/jobs/{job_id}/snapshots")["items"]
        return items

    def nodes(self, limit: int = 1000) -> list[dict[str, Any]]:
        body = self._call("GET", "/api/v1/nodes", params={"limit": limit})
        items: list[dict[str, Any]] = body["items"]
        return items

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
        items: list[dict[str, Any]] = self._call("GET", f"/api/v1/users/{user_id}/tokens")["items"]
        return items

    def revoke_token(self, token_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/api/v1/tokens/{token_id}/revoke")
        return result
