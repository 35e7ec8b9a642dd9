"""A per-layer progress bar for the quantization methods (a no-op when disabled)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def layer_progress(total: int, description: str, enabled: bool) -> Iterator[Callable[[], None]]:
    """Yields `advance()`: a rich progress bar over layers, or a no-op when disabled."""
    if not enabled:
        yield lambda: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    columns = (
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task(description, total=total)
        yield lambda: bar.advance(task)
