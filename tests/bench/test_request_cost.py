"""The request-cost bench runs end to end, small, against a baseline that is this code:
two real controllers side by side, each with its fleet's requests answered 2xx."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import request_cost

ROOT = Path(request_cost.__file__).resolve().parent.parent


@pytest.mark.e2e  # real controller processes, like the end-to-end tests
def test_the_bench_prices_each_kind_of_request_against_a_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "costs.json"
    small = ["--db", "sqlite", "--batches", "2", "--per-batch", "20"]
    request_cost.main([*small, "--baseline-code", str(ROOT), "--json", str(out)])
    printed = capsys.readouterr().out
    assert "this / baseline" in printed, printed
    results = json.loads(out.read_text())
    assert set(results) == {"this code", "baseline"}
    for result in results.values():
        assert result["code"] == str(ROOT)
        cpu, wall = result["cpu_ms_per_request_by_batch"], result["wall_ms_per_request_by_batch"]
        assert set(cpu) == set(wall) == set(request_cost.KINDS)
        for kind in request_cost.KINDS:
            assert len(cpu[kind]) == 2 and all(ms >= 0 for ms in cpu[kind]), (kind, cpu)
            assert len(wall[kind]) == 2 and all(ms > 0 for ms in wall[kind]), (kind, wall)
        assert sum(sum(b) for b in cpu.values()) > 0, cpu
