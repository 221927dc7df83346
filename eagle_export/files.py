"""One way in for the files the command line reads (checkpoint files, build artifacts, recipes, prompt
files, `.npy` arrays): an OSError or a malformed file becomes an EagleExportError that names the file,
the cause (permission, symbolic link loop, not a directory, a directory where a file goes, an object
array) and the fix for that cause. `restore` is the fix when the file itself is at fault."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
from pathlib import Path

from .errors import EagleExportError
from .lazy import lazy

np = lazy("numpy")  # read on first use: the command line's usage errors answer without it

RESTORE = "restore the file (or pass the right path)"
# No JSON, YAML, text or tokenizer file a command reads comes near this: a larger one is refused
# before it is read whole (a huge or sparse file would exhaust memory, not fail).
MAX_READ_BYTES = 256 << 20


def free_bytes(path) -> int:
    """Free bytes on the device holding `path` (or its nearest existing parent); unbounded if unknown."""
    for place in (Path(path), *Path(path).parents):
        with contextlib.suppress(OSError):
            return shutil.disk_usage(place).free
    return 1 << 62


def file_error(path, error: OSError, restore: str = RESTORE, needed: int | None = None,
               cls=EagleExportError) -> EagleExportError:
    """The error (of class `cls`) for `error`, raised on `path` (the error's own file name when it has
    one). `needed`: the bytes a write needed, for a full disk."""
    path = Path(error.filename if isinstance(error.filename, str) else path)
    code = error.errno
    if code in (errno.EACCES, errno.EPERM):
        return cls(f"{path} cannot be read or written by this user (permission denied)",
                   "fix its permissions (chmod u+rw for a file, u+rwx for a directory and those "
                   "above it), or run as its owner")
    if code == errno.ELOOP:
        return cls(f"{path} is a symbolic link loop (it leads back to itself)",
                   "point the link at the real file or directory (ls -l shows where it leads)")
    if code == errno.ENOTDIR:
        return cls(f"{path}: a part of this path is a file, not a directory",
                   "pass a path whose parents are directories")
    if code == errno.EISDIR:
        return cls(f"{path} is a directory where a file was expected", restore)
    if code == errno.ENOENT and os.path.islink(path):
        return cls(f"{path} is a symbolic link to a file that does not exist ({os.readlink(path)})",
                   "point the link at the real file")
    if code == errno.ENOENT:
        return cls(f"{path} does not exist", restore)
    if code in (errno.ENOSPC, errno.EDQUOT):
        need = f", about {needed / 2**20:.0f} MiB needed" if needed else ""
        return cls(f"no space left on the device holding {path} ({free_bytes(path) / 2**20:.0f} MiB free{need})",
                   "free space on that device, or write the output elsewhere (-o)")
    if code == errno.EROFS:
        return cls(f"{path} is on a read-only file system", "write the output elsewhere (-o)")
    return cls(f"{path} cannot be read ({error.strerror or type(error).__name__})", restore)


@contextlib.contextmanager
def reading(path, restore: str = RESTORE, cls=EagleExportError):
    """Any OSError in the body is `path`'s problem, named with its cause and fix (an error of class `cls`)."""
    try:
        yield
    except OSError as e:
        raise file_error(path, e, restore, cls=cls) from None


@contextlib.contextmanager
def replacing(path):
    """Yield a temporary file's path beside `path` for the body to write; renamed onto `path` when the
    body finishes, removed (and the error raised) when it fails. Readers, and a failure, Ctrl-C or a
    full disk, see the old file or the new one, never half of one; the new file gets the user's umask."""
    import tempfile

    path = Path(os.path.realpath(path))  # a link to the output is written through, as an open() would
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp's private 0600 would outlive the rename
        os.close(fd)
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) and tmp in (str(e.filename), str(e.filename2)):  # named as the output asked for
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def read_bytes(path, restore: str = RESTORE) -> bytes:
    with reading(path, restore):
        size = os.stat(path).st_size
        if size > MAX_READ_BYTES:
            raise EagleExportError(f"{path} is {size / 2**20:.0f} MiB, beyond what such a file can hold "
                                   f"({MAX_READ_BYTES >> 20} MiB at most)", restore)
        return Path(path).read_bytes()


def resolved(path) -> Path:
    """Path(path).resolve(), with a symbolic link loop named (Python < 3.13 raises RuntimeError)."""
    try:
        return Path(path).resolve()
    except RuntimeError:
        raise file_error(path, OSError(errno.ELOOP, "Too many levels of symbolic links")) from None
    except OSError as e:
        raise file_error(path, e) from None


def load_tokenizer(path):
    """A tokenizer.json, read through this module, refused by name when the tokenizers library cannot
    parse it (its own errors are a bare Exception)."""
    from tokenizers import Tokenizer

    text = read_text(path, "restore tokenizer.json from the checkpoint")
    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises plain Exception for every parse error
        raise EagleExportError(f"{path} is not a tokenizer the tokenizers library reads ({str(e)[:200]})",
                               "restore tokenizer.json from the checkpoint") from None


def read_text(path, restore: str = RESTORE) -> str:
    data = read_bytes(path, restore)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EagleExportError(f"{path} cannot be read as UTF-8 text (byte {e.start})", restore) from None


def read_json(path, restore: str = RESTORE):
    data = read_bytes(path, restore)
    try:
        return json.loads(data.decode("utf-8"))
    except ValueError as e:  # not JSON, or not UTF-8
        raise EagleExportError(f"{path} is not valid JSON ({e})", restore) from None


def list_dir(path, restore: str = RESTORE) -> list[Path]:
    """The entries of directory `path`, sorted; a file, a loop or an unreadable directory is named."""
    with reading(path, restore):
        return sorted(Path(path).iterdir())


def is_dir(path) -> bool:
    """Path.is_dir, except that a path that cannot be examined (a symbolic link loop or to nowhere, a
    directory above it that is unreadable or a file) raises its named error instead of reading as
    "not a directory". A path that does not exist is not a directory."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except FileNotFoundError:
        if os.path.islink(path):
            raise file_error(path, FileNotFoundError(errno.ENOENT, "No such file", str(path))) from None
        return False
    except OSError as e:
        raise file_error(path, e) from None


def load_int_array(path, restore: str = RESTORE) -> np.ndarray:
    """A `.npy` of integers (or booleans), loaded without pickle: an object array is refused, never run."""
    with reading(path, restore):
        try:
            array = np.load(path, allow_pickle=False)
        except ValueError as e:
            raise EagleExportError(f"{path} is not a plain .npy array ({e})", restore) from None
    if not isinstance(array, np.ndarray) or array.dtype.kind not in "iub":
        raise EagleExportError(f"{path} holds a {getattr(array, 'dtype', type(array).__name__)} array, not integers",
                               restore)
    return array
