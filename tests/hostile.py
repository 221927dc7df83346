"""Hostile file states for the command line's inputs, and a way to meet mode 000 as root does not."""

import contextlib
import os
import shutil
import stat
import tempfile
from pathlib import Path


@contextlib.contextmanager
def world_dir():
    """A temporary directory every user may enter (pytest's are private to their owner), so files in
    it can be read as another user; removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="eagle-export-hostile-"))
    path.chmod(0o777)
    try:
        yield path
    finally:
        for p in (path, *path.rglob("*")):
            with contextlib.suppress(OSError):
                if not p.is_symlink():
                    p.chmod(0o777 if p.is_dir() else 0o666)
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def unprivileged():
    """Run the body as a user that mode 000 stops: root reads any file, so root runs it as nobody
    (seteuid: the saved uid gets root back afterwards)."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def share(root: Path) -> None:
    """Make everything under `root` readable (and its directories enterable and writable) by any user."""
    for p in (root, *root.rglob("*")):
        if not p.is_symlink():
            p.chmod(0o777 if p.is_dir() else 0o666)


def _missing(path: Path):
    _remove(path)


def _mode_000(path: Path):
    path.chmod(0)


def _dir_for_file(path: Path):
    _remove(path)
    path.mkdir()
    (path / "x").write_text("x")


def _file_for_dir(path: Path):
    _remove(path)
    path.write_text("not a directory\n")


def _symlink_loop(path: Path):
    _remove(path)
    path.symlink_to(path.name)


def _empty(path: Path):
    if path.is_dir():
        shutil.rmtree(path)
        path.mkdir()
    else:
        path.write_bytes(b"")


def _truncated(path: Path):
    if path.is_dir():  # every file in it cut to a third
        for f in path.iterdir():
            if f.is_file():
                f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    else:
        path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 3)])


def _wrong_type_inside(path: Path):
    """JSON of the wrong shape where JSON goes, a pickled object array where an array goes, text elsewhere."""
    if path.is_dir():
        for f in path.iterdir():
            if f.is_file():
                _wrong_type_inside(f)
    elif path.suffix == ".npy":
        import numpy as np

        np.save(path, np.array([object()] * 4), allow_pickle=True)
    elif path.suffix in (".json", ".yaml", ".yml"):
        path.write_text("[1, 2, 3]\n")
    else:
        path.write_bytes(b"\x00\xffnot this file's format\x00" * 8)


def _huge(path: Path):
    """A sparse file past the largest a command reads whole (files.MAX_READ_BYTES): no disk used, and
    small enough that hashing it stays quick."""
    from eagle_export.files import MAX_READ_BYTES

    with open(path, "r+b" if path.exists() else "wb") as f:
        f.truncate(MAX_READ_BYTES + (16 << 20))


def _remove(path: Path):
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


# name -> how to put a path in that state
STATES = {"missing": _missing, "mode 000": _mode_000, "directory for file": _dir_for_file,
          "file for directory": _file_for_dir, "symlink loop": _symlink_loop, "empty": _empty,
          "truncated": _truncated, "wrong type inside": _wrong_type_inside, "huge": _huge}


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under `root` with its type, size and mtime: what a refused command must leave as it was."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[p.relative_to(root).as_posix()] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns)
    return out
