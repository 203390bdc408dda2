"""The report-cost bench runs end to end, small, against a baseline that is this code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import report_cost

ROOT = Path(report_cost.__file__).resolve().parent.parent


def test_the_bench_prices_each_kind_of_report_against_a_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "costs.json"
    small = ["--jobs", "3", "--db", "sqlite", "--rounds", "1"]
    report_cost.main([*small, "--baseline-code", str(ROOT), "--json", str(out)])
    printed = capsys.readouterr().out
    assert "every run's jobs ended with the same timelines" in printed
    assert "a job's reports cost the baseline" in printed
    results = json.loads(out.read_text())
    assert set(results) == {"this code", "baseline"}
    for result in results.values():
        assert result["job_states"] == [{"SUCCEEDED": 3}], result["job_states"]
        (timelines,) = result["timelines"]
        (kinds, jobs), *others = timelines
        assert not others and jobs == 3, timelines
        assert kinds[-1] == "node_finished" and "succeeded" in kinds, kinds
        assert set(result["per_report"]) == set(report_cost.KINDS)
        for kind, cost in result["per_report"].items():
            assert cost["statements"] >= 1 and cost["cpu_ms"] > 0, (kind, cost)
