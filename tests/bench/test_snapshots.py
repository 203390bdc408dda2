"""The snapshot benchmark's GPU option refuses to run, saying why, where torch sees no GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench import snapshots


def test_device_cuda_without_a_gpu_fails_before_any_work(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU host

    def no_work(*_: object) -> float:
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(snapshots, "run", no_work)
    with pytest.raises(SystemExit, match=r"--device cuda needs a CUDA GPU: torch .* sees none"):
        snapshots.main(["--device", "cuda", "--dir", str(tmp_path)])
