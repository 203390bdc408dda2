"""The dashboard is static files that carry no data and load nothing from elsewhere."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from service.api.app import DASHBOARD_DIR


def test_the_dashboard_is_served_and_the_root_leads_to_it(api: TestClient) -> None:
    home = api.get("/", follow_redirects=False, headers={"authorization": ""})
    assert home.status_code == 307 and home.headers["location"] == "/dashboard/"
    page = api.get("/dashboard/", headers={"authorization": ""})
    assert page.status_code == 200 and "<title>relaunch</title>" in page.text
    for asset in ("app.js", "style.css"):
        assert api.get(f"/dashboard/{asset}", headers={"authorization": ""}).status_code == 200
    assert api.get("/dashboard/../service/settings.py").status_code == 404


def test_the_dashboard_loads_nothing_from_the_internet() -> None:
    for path in DASHBOARD_DIR.iterdir():
        text = path.read_text()
        remote = re.findall(r"""(?:src|href)\s*=\s*["'](?:https?:)?//""", text)
        remote += re.findall(r"""(?:fetch|import)\s*\(\s*["'`]https?://""", text)
        remote += re.findall(r"@import\s+url\(\s*[\"']?https?://", text)
        assert remote == [], (path.name, remote)


def test_the_dashboard_never_writes_data_as_markup() -> None:
    script = (DASHBOARD_DIR / "app.js").read_text()
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script
    assert "document.write" not in script
