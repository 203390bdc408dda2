"""Random-number generator states, captured into a snapshot and restored from it."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class RngState:
    """The random-number generator states a rank needs to continue identically."""

    torch_cpu: torch.Tensor
    torch_cuda: torch.Tensor | None = None
    python: list[Any] | None = None

    @classmethod
    def capture(cls, device: torch.device | None = None) -> RngState:
        """The current CPU (and ``device``'s CUDA) generator states."""
        cuda = None
        if device is not None and device.type == "cuda":
            cuda = torch.cuda.get_rng_state(device)
        version, internal, gauss = random.getstate()
        return cls(
            torch_cpu=torch.get_rng_state(),
            torch_cuda=cuda,
            python=[version, list(internal), gauss],
        )

    def restore(self, device: torch.device | None = None) -> None:
        """Put the captured states back (the CUDA one only when ``device`` is CUDA)."""
        torch.set_rng_state(self.torch_cpu)
        if self.torch_cuda is not None and device is not None and device.type == "cuda":
            torch.cuda.set_rng_state(self.torch_cuda, device)
        if self.python is not None:
            version, internal, gauss = self.python
            random.setstate((version, tuple(internal), gauss))

    def to_payload(self) -> dict[str, Any]:
        return {"torch_cpu": self.torch_cpu, "torch_cuda": self.torch_cuda, "python": self.python}

    @classmethod
    def from_payload(cls, payload: Any) -> RngState:
        if not isinstance(payload, dict) or not isinstance(payload.get("torch_cpu"), torch.Tensor):
            raise ValueError("rng state must be a dict with a torch_cpu tensor")
        return cls(
            torch_cpu=payload["torch_cpu"],
            torch_cuda=payload.get("torch_cuda"),
            python=payload.get("python"),
        )
