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
    def __init__(self, base_url: str, timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s)

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
        return response.json()

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/healthz")
        return result

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", "/api/v1/jobs", json=spec)
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

    def nodes(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self._call("GET", "/api/v1/nodes")["items"]
        return items
