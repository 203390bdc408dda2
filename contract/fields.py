"""Bounded field types of the wire models: what the controller's database can hold.

PostgreSQL text holds no NUL character, ids are 64-bit and counts 32-bit
there; a value that does not fit is refused where a message is parsed (a 422
at the controller) instead of failing in the database.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    return value


def _nul_shown(value: str) -> str:
    return value.replace("\x00", "\ufffd")


def _finite_or_none(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


def _sha256_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) else None


# A name or address with a NUL is refused; what a worker printed keeps its line,
# with U+FFFD where the NUL was.
PlainText = Annotated[str, AfterValidator(_no_nul)]
PrintedText = Annotated[str, AfterValidator(_nul_shown)]

Id = Annotated[int, Field(ge=0, le=2**63 - 1)]
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Count = Annotated[int, Field(ge=0, le=2**31 - 1)]  # steps, ranks, sizes of a world
ByteCount = Annotated[int, Field(ge=0, le=2**63 - 1)]  # a snapshot can pass 2 GiB
# NaN and the infinities are not JSON, and a digest that is not 64 hex digits is none:
# each reads as "no value".
FiniteOrNone = Annotated[float | None, AfterValidator(_finite_or_none)]
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Sha256OrNone = Annotated[Sha256 | None, BeforeValidator(_sha256_or_none)]
