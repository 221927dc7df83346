"""What is still alive when each drafter graph's export begins: the export and build tests' watch on
the one-copy-of-every-weight rule."""

from __future__ import annotations

import gc
import weakref


def watch_drafter_exports(patch, loading_module) -> list[tuple[bool, bool, bool]]:
    """Wrap `loading_module.load_pair` (the module whose name the command calls it by) to remember the
    loaded target, its first layer and the embedding table the drafter shares, weakly, and
    `export_drafter` to record, after a collection, which of the three are alive when it is called.
    `patch`: a pytest MonkeyPatch. Returns the list the records go to, one per drafter graph."""
    import eagle_export.export.export as export_module

    loaded, alive = [], []
    real_load_pair, real_export_drafter = loading_module.load_pair, export_module.export_drafter

    def load_and_watch(*args, **kwargs):
        target, drafter = real_load_pair(*args, **kwargs)
        loaded.append((weakref.ref(target), weakref.ref(target.layers[0]), weakref.ref(drafter.embed_tokens)))
        return target, drafter

    def export_and_watch(drafter, *args, **kwargs):
        gc.collect()
        alive.append(tuple(ref() is not None for ref in loaded[0]))
        return real_export_drafter(drafter, *args, **kwargs)

    patch.setattr(loading_module, "load_pair", load_and_watch)
    patch.setattr(export_module, "export_drafter", export_and_watch)
    return alive
