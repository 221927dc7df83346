"""The old home of `eagle_export.builder`, importable for one release (0.2 removes it).

The package folder was `eagle_export/build/` until 0.1.x; common `.gitignore` templates carry an
unanchored `build/` line that silently drops such a folder from a fork or a vendored copy, so it is
`builder/` now. `import eagle_export.build.build_dir` (the Python API's `open_build` lives there)
still works: each `eagle_export.build.X` is the very module `eagle_export.builder.X`, with a
DeprecationWarning naming the new path. A file, not a folder, so the same templates keep it."""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__path__: list[str] = []  # a package to the import system, so `eagle_export.build.X` reaches the finder below
_OLD, _NEW = __name__, __name__ + "er"


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`eagle_export.build.X` -> the module `eagle_export.builder.X`, loaded once under both names."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_OLD + "."):
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = _NEW + spec.name[len(_OLD):]
        warnings.warn(f"{spec.name} is now {new}; the old path goes in 0.2", DeprecationWarning, stacklevel=3)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # the real module ran when it was imported under its own name


if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
    sys.meta_path.append(_Alias())
