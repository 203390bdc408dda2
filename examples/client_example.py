"""Submit a job from Python, wait for it with a time limit, and print its final loss.

    RELAUNCH_URL=127.0.0.1:8080 RELAUNCH_TOKEN=rlu_... python examples/client_example.py

The job trains the built-in regression task on one node. If it has not ended within
--timeout seconds, it is cancelled. Exits 0 when the job succeeded.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from service.client import RelaunchClient, RelaunchError, WaitTimeout

SPEC: dict[str, Any] = {
    "name": "client-example",
    "task": {"name": "regression", "params": {"epochs": 2}},
    "nnodes": "1",
}


def all_metrics(client: RelaunchClient, job_id: int) -> list[dict[str, Any]]:
    """Every metric of the job: the API returns them a page at a time."""
    metrics: list[dict[str, Any]] = []
    while page := client.metrics(job_id, after_id=metrics[-1]["id"] if metrics else 0):
        metrics += page
    return metrics


def run(client: RelaunchClient, timeout_s: float) -> int:
    job = client.submit(SPEC)
    print(f"submitted job {job['id']} ({job['name']})")
    try:
        job = client.wait(job["id"], timeout_s=timeout_s, poll_s=2.0)
    except WaitTimeout as exc:
        client.cancel(exc.job["id"])
        print(f"{exc}; cancelled it", file=sys.stderr)
        return 1
    if job["state"] != "SUCCEEDED":
        print(f"job {job['id']} ended {job['state']}: {job['message']}", file=sys.stderr)
        return 1
    losses = [m for m in all_metrics(client, job["id"]) if m["loss"] is not None]
    if not losses:
        print(f"job {job['id']} succeeded without reporting a loss", file=sys.stderr)
        return 1
    last = losses[-1]
    print(f"job {job['id']} succeeded: final loss {last['loss']:.4f} at step {last['step']}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait")
    args = parser.parse_args()
    try:
        with RelaunchClient() as client:  # RELAUNCH_URL and RELAUNCH_TOKEN
            return run(client, args.timeout)
    except RelaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
