"""What `longrun run` prints while its job runs: the controller's lines (state changes, events,
one progress line per logged step) in order, and in a terminal a live bar under them.

Piped or in a file the lines are plain text, with no escape codes and no bar: a log to grep. In a
terminal the state lines are coloured and a rich progress bar (step, loss, eta, attempt) stays at
the bottom while the lines scroll above it.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from longrun.cli.common import shown
from longrun.observability.progress import StepLine, hms


class JobConsole:
    def __init__(self, console: Console, total_steps: int):
        self.console = console
        self._bar: Progress | None = None
        if console.is_terminal:
            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[detail]}"), console=console, transient=True)
            self._task = self._bar.add_task("training", total=total_steps, detail="")

    def __enter__(self) -> JobConsole:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def line(self, line: str) -> None:
        """One line from the controller (its `on_event`)."""
        if isinstance(line, StepLine):
            self.console.print(shown(line), highlight=False)
            if self._bar is not None:
                self._bar.update(self._task, completed=line.step, description=f"attempt {line.attempt}",
                                 detail=f"loss {line.loss:.4f}  eta {hms(line.eta_s)}")
        else:
            self.console.print(f"[cyan]{shown(line)}[/]", highlight=False)
