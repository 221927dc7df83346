"""Progress on long loops: a tqdm bar with ETA on a terminal, nothing of its own in a log.

A bar is drawn on stderr only when stderr is a terminal and `eagle-export --quiet` is off. Elsewhere
(CI logs, redirected output, --quiet) the plain lines the commands print (`[3/7] quantize ...`,
`quantizing the target to fp8 on 16 prompts`) are the whole record: no carriage returns in a file.
Loops that take minutes (bench's batches, diagnose's prompts) also `say` a plain line as each step
finishes, with what it measured so far: on stderr (stdout keeps the results), above a bar where one
is drawn, in a log where none is, and not at all with --quiet.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from tqdm import tqdm

QUIET = False  # set by `eagle-export --quiet`


def bars_on() -> bool:
    return not QUIET and sys.stderr.isatty()


def say(text: str) -> None:
    """One progress line on stderr (above the bar, if one is drawn); nothing with --quiet."""
    if not QUIET:
        tqdm.write(text, file=sys.stderr)


def track(items: Iterable, description: str, total: int | None = None) -> Iterable:
    """`items`, drawn as a bar with ETA while they are consumed where bars are on; else `items` itself."""
    if not bars_on():
        return items
    return tqdm(items, desc=description, total=total, leave=False, file=sys.stderr, dynamic_ncols=True)
