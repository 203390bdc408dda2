"""The web dashboard in headless Chromium (Debian's package, driven by Playwright) against a
real controller with real agents and a real job: sign-in, the job list, progress, a worker
kill on the timeline and the curve, cancel from the button, a killed node shown as lost,
and a controller restart shown as "reconnecting" and then caught up. Short values in the
tables (times, event kinds, states, counts) stay on one line. The API docs load nothing from
another host.

Each page's screenshot is kept in ``test-artifacts/dashboard/``.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from service.client import RelaunchClient
from service.local_cluster import LocalCluster
from tests.e2e.helpers import POLL_S, regression, running_cluster
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

CHROMIUM = "/usr/bin/chromium"
# As root in a sandbox, with no network beyond this machine: no sandbox, no GPU, and
# none of Chromium's own background connections.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard"
UI_TIMEOUT_MS = 60_000
expect.set_options(timeout=UI_TIMEOUT_MS)

# The cells of short values, which must never wrap: on the jobs list all but the name and
# owner; on a job's page the timeline's time and event kind, the attempts' number, state and
# world size, and the snapshots; on the nodes page all but the name and address.
JOBS_SHORT = "[data-testid=jobs] th, [data-testid=jobs] td:not(:nth-child(2), :nth-child(8))"
TIMELINE_SHORT = "[data-testid=timeline] td:nth-child(-n+2)"
ATTEMPTS_SHORT = "[data-testid=attempts] td:nth-child(-n+3)"
SNAPSHOTS = "[data-testid=snapshots] td"
NODES_SHORT = "[data-testid=nodes] th, [data-testid=nodes] td:nth-child(n+2):nth-child(-n+5)"
# For each cell a selector matches: its text, and how many lines that text takes on the screen
# (line boxes its text fragments lie on; fragments of one line are within half a line's height).
LINES_OF_CELLS = """(selector) => [...document.querySelectorAll(selector)].map((cell) => {
  const style = getComputedStyle(cell);
  const lineHeight = parseFloat(style.lineHeight) || parseFloat(style.fontSize);
  const tops = [];
  const texts = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
  for (let text = texts.nextNode(); text; text = texts.nextNode()) {
    const range = document.createRange();
    range.selectNodeContents(text);
    for (const rect of range.getClientRects()) if (rect.width > 0) tops.push(rect.top);
  }
  tops.sort((a, b) => a - b);
  const lines = tops.filter((top, i) => i === 0 || top - tops[i - 1] > lineHeight / 2).length;
  return [cell.innerText, lines];
})"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    env = {"RELAUNCH_NODE_TIMEOUT_S": "3"}
    data = tmp_path_factory.mktemp("dashboard")
    with running_cluster(data, ("node-a", "node-b"), controller_env=env) as c:
        yield c


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Browser, cluster: LocalCluster) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(UI_TIMEOUT_MS)
    page.goto(f"{cluster.url}/")
    yield page
    context.close()


def sign_in(page: Page, token: str) -> None:
    page.fill("#token", token)
    page.click("#login button[type=submit]")
    expect(page.locator("#who")).to_contain_text("(admin)")


def shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def assert_one_line(page: Page, cells: str) -> None:
    """Every cell ``cells`` selects, and it selects at least one, shows its text on one line."""
    lines = page.evaluate(LINES_OF_CELLS, cells)
    assert lines, f"no cell matches {cells}"
    assert [text for text, count in lines if count != 1] == [], lines


def step_shown(page: Page, job_id: int) -> int:
    text = page.locator(f'tr[data-job="{job_id}"] [data-testid=progress]').inner_text()
    return int(text.split("/")[0])


def test_nothing_shows_without_a_token_and_a_bad_token_is_refused(
    page: Page, cluster: LocalCluster
) -> None:
    expect(page.locator("#login")).to_be_visible()
    assert page.locator("[data-testid=jobs]").count() == 0
    page.fill("#token", "rlu_not-a-token")
    page.click("#login button[type=submit]")
    expect(page.locator("#login-error")).to_contain_text("refused")
    assert page.locator("[data-testid=jobs]").count() == 0


def test_a_job_is_watched_killed_restarted_and_cancelled_from_the_page(
    page: Page, cluster: LocalCluster
) -> None:
    assert cluster.admin_token is not None
    sign_in(page, cluster.admin_token)
    with cluster.client() as client:
        spec = regression("watched", "2:2", params={"epochs": 8, "step_delay": 0.15})
        job_id = client.submit(spec)["id"]

        row = page.locator(f'tr[data-job="{job_id}"]')
        expect(row).to_be_visible()
        expect(row.locator("[data-testid=state]")).to_have_text("RUNNING")
        wait_for("progress on the page", lambda: step_shown(page, job_id) > 0, 60, POLL_S)
        first = step_shown(page, job_id)
        wait_for("progress to move", lambda: step_shown(page, job_id) > first, 60, POLL_S)
        shot(page, "jobs")
        assert_one_line(page, JOBS_SHORT)

        row.locator("a").first.click()
        expect(page.locator("[data-testid=loss-line]")).to_be_visible()
        kill_one_worker(cluster, client, job_id)
        timeline = page.locator("[data-testid=timeline]")
        # The killed worker, and maybe its peer that lost it: one restart either way.
        expect(timeline.locator('tr[data-kind="worker_failed"]').first).to_be_visible()
        expect(timeline.locator('tr[data-kind="restarting"]')).to_have_count(1)
        expect(page.locator("[data-testid=restart-marker]")).to_have_count(1)
        wait_for("training after the restart", lambda: client.job(job_id)["state"] == "RUNNING", 60)
        expect(timeline.locator('tr[data-kind="resumed"]')).to_have_count(1)
        expect(page.locator("[data-testid=log-tail]").first).not_to_be_empty()
        expect(page.locator("[data-testid=spec]")).to_contain_text('"max_restarts": 3')
        shot(page, "job")
        for cells in (TIMELINE_SHORT, ATTEMPTS_SHORT, SNAPSHOTS):
            assert_one_line(page, cells)

        page.once("dialog", lambda dialog: dialog.accept())
        page.click("[data-testid=cancel]")
        expect(page.locator("h2 [data-testid=state]")).to_have_text("CANCELLED")
        assert client.job(job_id)["state"] == "CANCELLED"
        expect(page.locator("[data-testid=cancel]")).to_have_count(0)
        # The finished job's page keeps polling, and unchanged answers come back as 304s.
        wait_for(
            "conditional polls",
            lambda: page.evaluate("window.relaunchStats().notModified") > 3,
            30,
            POLL_S,
        )


def test_a_script_with_its_own_snapshots_shows_its_loss_curve_restart_and_resume(
    page: Page, cluster: LocalCluster
) -> None:
    assert cluster.admin_token is not None
    sign_in(page, cluster.admin_token)
    script = Path(__file__).resolve().parents[2] / "examples" / "ddp_script.py"
    args = ["--epochs", "6", "--points", "512", "--batch-size", "16", "--step-delay", "0.1"]
    spec = {
        "name": "own-script",
        "script": {"path": str(script), "args": args},
        "nnodes": "2:2",
        "max_restarts": 3,
    }
    with cluster.client() as client:
        job_id = client.submit(spec)["id"]
        page.locator(f'tr[data-job="{job_id}"] a').first.click()
        expect(page.locator("[data-testid=loss-line]")).to_be_visible()
        expect(page.locator("h2 + p + p")).to_contain_text("s/step")
        steps_per_epoch = 512 // (16 * 2)
        wait_for(
            "two epochs (two snapshots)",
            lambda: (client.job(job_id)["last_step"] or 0) >= 2 * steps_per_epoch + 2,
            180,
            POLL_S,
        )
        kill_one_worker(cluster, client, job_id)
        timeline = page.locator("[data-testid=timeline]")
        expect(page.locator("[data-testid=restart-marker]")).to_have_count(1)
        resumed = timeline.locator('tr[data-kind="resumed"]')
        expect(resumed).to_contain_text("resumed from snapshot at step")
        expect(page.locator("h2 [data-testid=state]")).to_have_text("SUCCEEDED")
        expect(page.locator("[data-testid=loss-line]")).to_be_visible()
        shot(page, "script-job")


def kill_one_worker(cluster: LocalCluster, client: RelaunchClient, job_id: int) -> None:
    workers = wait_for("the job's workers", lambda: cluster.job_workers(job_id), 60, POLL_S)
    workers[-1].send_signal(signal.SIGKILL)


def test_a_killed_node_shows_as_lost(page: Page, cluster: LocalCluster) -> None:
    assert cluster.admin_token is not None
    sign_in(page, cluster.admin_token)
    cluster.start_agent("node-doomed")
    cluster.wait_nodes(3)
    page.click("[data-nav=nodes]")
    doomed = page.locator('tr[data-node="node-doomed"] [data-testid=state]')
    expect(doomed).to_have_text("ALIVE")
    cluster.kill_node("node-doomed")
    expect(doomed).to_have_text("LOST")
    expect(page.locator('tr[data-node="node-a"] [data-testid=state]')).to_have_text("ALIVE")
    shot(page, "nodes")
    assert_one_line(page, NODES_SHORT)


def test_a_controller_restart_shows_reconnecting_then_catches_up(
    page: Page, cluster: LocalCluster
) -> None:
    assert cluster.admin_token is not None
    sign_in(page, cluster.admin_token)
    connection = page.locator("[data-testid=connection]")
    expect(connection).to_contain_text("updated")
    cluster.stop("controller")
    expect(connection).to_have_text("reconnecting…")
    expect(page.locator("#view")).to_have_class(re.compile(r"\bstale\b"))
    shot(page, "reconnecting")
    cluster.start_controller()
    with cluster.client() as client:
        job_id = client.submit(regression("after-restart", "1", params={"epochs": 1}))["id"]
    expect(connection).to_contain_text("updated")
    expect(page.locator(f'tr[data-job="{job_id}"]')).to_be_visible()
    expect(page.locator("#view")).not_to_have_class(re.compile(r"\bstale\b"))


def test_the_api_docs_load_nothing_from_another_host(page: Page, cluster: LocalCluster) -> None:
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto(f"{cluster.url}/docs")
    # Swagger UI rendered the API (a block for each operation), from files and a document that
    # all came from the controller.
    expect(page.locator(".opblock-summary-path", has_text="/api/v1/jobs").first).to_be_visible()
    page.wait_for_load_state("networkidle")
    assert f"{cluster.url}/openapi.json" in requested
    assert [url for url in requested if not url.startswith(f"{cluster.url}/")] == []
    shot(page, "api-docs")
