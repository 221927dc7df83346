"""Heavy libraries imported on first use.

Importing torch takes 1-2 s on an idle 2-core machine and 5-10 s on a loaded one; commands that need
no model (usage errors, --help, `inspect BUILD`, `doctor` without a GPU, `selftest` without a GPU)
must answer at once, so modules on their import path name torch through `lazy("torch")`: the proxy
imports it at the first attribute read, and every later read is a lookup in `sys.modules`.
"""

from __future__ import annotations

import importlib


class LazyModule:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


def lazy(name: str) -> LazyModule:
    return LazyModule(name)
