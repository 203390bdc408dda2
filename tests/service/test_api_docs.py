"""The API docs (/docs) are served whole by the controller, without a credential, and the page
loads nothing from another host: it works on a machine without internet."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

# What each kind of file the docs page loads must be served as.
CONTENT_TYPES = {
    ".js": "text/javascript",
    ".css": "text/css",
    ".png": "image/png",
    ".json": "application/json",
}
# Every address the docs page names: attributes, and the OpenAPI document given to the script.
ADDRESS = re.compile(r"""(?:\b(?:src|href)\s*=\s*|\burl:\s*)["']([^"']*)["']""")


def test_the_docs_page_loads_only_files_the_controller_serves(api: TestClient) -> None:
    page = api.get("/docs", headers={"authorization": ""})
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert re.search(r"https?://|//[a-z]", page.text, re.IGNORECASE) is None, page.text
    urls = ADDRESS.findall(page.text)
    assert "/openapi.json" in urls and any(url.endswith(".js") for url in urls), urls
    for url in urls:
        assert url.startswith("/") and not url.startswith("//"), url
        asset = api.get(url, headers={"authorization": ""})
        assert asset.status_code == 200, url
        kind = CONTENT_TYPES[url[url.rindex(".") :]]
        assert asset.headers["content-type"].startswith(kind), (url, asset.headers)
        assert asset.content, url


def test_there_is_no_redoc_page(api: TestClient) -> None:
    # ReDoc's script always loads a logo from the internet, so it is not served.
    assert api.get("/redoc", headers={"authorization": ""}).status_code == 404
