"""A job's timeline as a table: what ``relaunch status`` and ``relaunch demo`` print."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def timeline_table(events: list[dict[str, Any]], title: str = "timeline") -> Table:
    """``events`` (as the API lists them, oldest first) as a table."""
    table = Table("time", "event", "what happened", title=title)
    for event in events:
        # Messages quote workers' errors, which may hold "[...]"; print them as text.
        table.add_row(event["time"][11:23], event["kind"], escape(event["message"]))
    return table


def print_timeline(console: Console, events: list[dict[str, Any]]) -> None:
    """Print ``events`` (as the API lists them, oldest first) on ``console``."""
    console.print(timeline_table(events))
