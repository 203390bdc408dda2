"""A job's timeline as a table: what ``relaunch status`` and ``relaunch demo`` print."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def print_timeline(console: Console, events: list[dict[str, Any]]) -> None:
    """Print ``events`` (as the API lists them, oldest first) on ``console``."""
    table = Table("time", "event", "what happened", title="timeline")
    for event in events:
        # Messages quote workers' errors, which may hold "[...]"; print them as text.
        table.add_row(event["time"][11:23], event["kind"], escape(event["message"]))
    console.print(table)
