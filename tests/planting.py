"""Planted runtime bugs: a runtime function replaced wherever the runtime's modules bind it.

The runtime's row helpers are defined in one module and imported by name into others (`rows._write_rows`
into the general round's `runtime.py` and the device round's `device_round.py`), so replacing one module's
binding would reach some paths and not others. `plant` replaces every binding of the same function."""

import importlib

RUNTIME_MODULES = ("eagle_export.runtime.rows", "eagle_export.runtime.device_round", "eagle_export.runtime.runtime")


def plant(monkeypatch, name: str, wrap) -> None:
    """The runtime's function `name` replaced by wrap(original) in every runtime module that binds it (where
    it is defined and where it is imported by name): the general round, the device round and the pending
    rows all call the replacement."""
    modules = [importlib.import_module(m) for m in RUNTIME_MODULES]
    original = next(getattr(m, name) for m in modules if hasattr(m, name))
    replacement = wrap(original)
    bound = [m for m in modules if getattr(m, name, None) is original]
    for module in bound:
        monkeypatch.setattr(module, name, replacement)
