"""A character-level GRU language model on a generated corpus of arithmetic lines.

Corpus: lines like ``17+25=42`` and ``30-58=-28``, one per line, with operands
drawn from a fixed data seed (no text comes from anywhere else). Most of a line
is random and cannot be predicted, but its shape and its answer can: a model that
learns to add and subtract gets its loss well below the uniform ``ln(vocab)``.
The loss is cross-entropy in nats per character; the final evaluation logs it on
the whole corpus plus greedy completions of a few prompts.

Run: ``python -m torch.distributed.run --nproc-per-node 2 -m worker.tasks.charlm``.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.data import TensorDataset

from contract.tasks import CharLMParams
from worker.tasks.cli import TaskParts, run_task

logger = logging.getLogger(__name__)

DATA_SEED = 8192
VOCAB = "0123456789+-=\n"
CHAR_TO_ID = {char: index for index, char in enumerate(VOCAB)}


def make_corpus(lines: int, max_operand: int, seed: int = DATA_SEED) -> str:
    """``lines`` lines ``a+b=c`` or ``a-b=c`` with ``0 <= a, b <= max_operand``."""
    generator = torch.Generator().manual_seed(seed)
    operands = torch.randint(0, max_operand + 1, (lines, 2), generator=generator).tolist()
    signs = torch.randint(0, 2, (lines,), generator=generator).tolist()
    out = []
    for (a, b), minus in zip(operands, signs, strict=True):
        out.append(f"{a}-{b}={a - b}\n" if minus else f"{a}+{b}={a + b}\n")
    return "".join(out)


def encode(text: str) -> torch.Tensor:
    return torch.tensor([CHAR_TO_ID[char] for char in text], dtype=torch.long)


def decode(ids: Sequence[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def make_dataset(text: str, seq_len: int) -> TensorDataset:
    """Non-overlapping windows: input ``text[s:s+seq_len]``, target shifted by one."""
    ids = encode(text)
    count = (len(ids) - 1) // seq_len
    if count < 1:
        raise ValueError(f"corpus of {len(ids)} characters is shorter than seq_len {seq_len}")
    inputs = ids[: count * seq_len].view(count, seq_len)
    targets = ids[1 : count * seq_len + 1].view(count, seq_len)
    return TensorDataset(inputs, targets)


class CharGRU(nn.Module):
    """Embedding → one GRU layer → linear head; ``(batch, time)`` ids to logits."""

    def __init__(self, vocab: int, embed: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.gru = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        states, _ = self.gru(self.embed(ids))
        return self.head(states)

    @torch.no_grad()
    def complete(self, prompt: str, max_chars: int = 12) -> str:
        """Greedy continuation of ``prompt`` up to the end of its line."""
        ids = encode(prompt).unsqueeze(0)
        states, hidden = self.gru(self.embed(ids))
        next_id = int(self.head(states[:, -1]).argmax())
        out: list[int] = []
        while len(out) < max_chars and VOCAB[next_id] != "\n":
            out.append(next_id)
            states, hidden = self.gru(self.embed(torch.tensor([[next_id]])), hidden)
            next_id = int(self.head(states[:, -1]).argmax())
        return decode(out)


def nats_per_char(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def build(params: CharLMParams) -> TaskParts:
    text = make_corpus(params.lines, params.max_operand)
    dataset = make_dataset(text, params.seq_len)
    model = CharGRU(len(VOCAB), params.embed, params.hidden)

    def evaluate(trained: nn.Module) -> None:
        inputs, targets = dataset.tensors
        with torch.no_grad():
            loss = nats_per_char(trained(inputs), targets).item()
        logger.info(
            "final loss %.4f nats/char on the corpus (uniform guess %.3f); %d lines, %d "
            "characters, %d samples; %d parameters",
            loss,
            math.log(len(VOCAB)),
            params.lines,
            len(text),
            len(dataset),
            sum(p.numel() for p in trained.parameters()),
        )
        if isinstance(trained, CharGRU):
            probe = torch.Generator().manual_seed(DATA_SEED + 1)
            for a, b in torch.randint(0, params.max_operand + 1, (3, 2), generator=probe).tolist():
                prompt = f"{a}+{b}="
                logger.info("%s%s (true %d)", prompt, trained.complete("\n" + prompt), a + b)

    return TaskParts(
        model=model,
        optimizer=lambda ps: torch.optim.Adam(ps, lr=params.lr),
        dataset=dataset,
        loss_fn=nats_per_char,
        evaluate=evaluate,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run_task("charlm", CharLMParams, build, argv)


if __name__ == "__main__":
    sys.exit(main())
