"""A seeded random fault campaign against one job: every kind of fault once, in an order
drawn from a fixed seed, on nodes that are hosts of their own (network namespaces).

The engine is the benchmark's (``bench.chaos``), so the test and ``python -m
bench.chaos`` draw and check the same way; here with a shorter node timeout and one
fault of each kind, as soon as the last one has settled.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from bench.chaos import KINDS, Campaign, print_report
from bench.hosts import can_make_hosts
from tests.e2e.helpers import NODE_TIMEOUT_S, dump_logs

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not can_make_hosts(), reason="network namespaces need root and ip"),
]

# Draws, from three nodes: network cut, node freeze, agent restart, controller restart,
# worker kill, node kill (and its replacement), new node: the world shrinks and grows
# before a spare exists.
SEED = 12
# Long enough that the job outlasts the campaign on a busy machine: seven faults took the
# campaign about 65 s here, and the job trains about 35 s of its 45 epochs undisturbed.
# Once, on a loaded machine, 45 epochs ended after three faults.
EPOCHS = 70


@pytest.mark.timeout(900)
def test_a_job_keeps_its_invariants_through_a_random_fault_of_every_kind(
    tmp_path: Path,
) -> None:
    campaign = Campaign(tmp_path, SEED, node_timeout_s=NODE_TIMEOUT_S)
    try:
        with campaign.running():
            result = campaign.run(
                minutes=10, interval_s=3, epochs=EPOCHS, step_delay=0.06, max_faults=len(KINDS)
            )
        campaign.finish(result)
    finally:
        dump_logs(tmp_path / "controller")
    print("\n".join(result.timeline))
    print_report(result, Console(width=200))
    print(json.dumps(result.to_json()["targets"]))  # what the benchmark writes, too

    drawn = {f.kind for f in result.faults}
    assert drawn == set(KINDS), (
        f"faults never drawn: {sorted(set(KINDS) - drawn)}; the job ended "
        f"{result.job['state']} after {[(f.kind, f.at_s, f.spent_s) for f in result.faults]}"
    )
    failed = [f"{c.name}: {c.detail}" for c in result.checks() if not c.ok]
    assert not failed, failed
