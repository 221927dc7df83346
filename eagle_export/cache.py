"""The user cache: the sample target, downloaded data sets, measured costs, conformance results.

`EAGLE_EXPORT_CACHE` when set, else `$XDG_CACHE_HOME/eagle-export`, else `~/.cache/eagle-export`.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    if os.environ.get("EAGLE_EXPORT_CACHE"):
        return Path(os.environ["EAGLE_EXPORT_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "eagle-export"
