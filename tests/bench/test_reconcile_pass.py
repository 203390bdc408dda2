"""The reconciler-pass bench runs end to end on a small queue."""

from __future__ import annotations

import pytest

from bench import reconcile_pass


def test_the_bench_times_both_reads_of_the_queue(capsys: pytest.CaptureFixture[str]) -> None:
    reconcile_pass.main(
        [
            "--nodes",
            "3",
            "--jobs",
            "12",
            "--passes",
            "2",
            "--db",
            "sqlite",
            "--free",
            "2",
            "--reps",
            "1",
        ]
    )
    out = capsys.readouterr().out
    for row in ("head (no page)", "whole (as before)", "head (one page)"):
        assert row in out
    assert "CPU p50 ms" in out  # the pass's thread's time on a CPU, beside its wall time
    assert "a whole read's pass takes" in out
    assert "placing 2 jobs, batches against one a transaction" in out
