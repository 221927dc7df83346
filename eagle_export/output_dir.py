"""The atomic output directory: a build (or an exported checkpoint) is written into a temporary
directory beside its output and renamed into place only when complete, so a failure, Ctrl-C or
SIGTERM never leaves half an output, and `--force` replaces only this tool's own output, never what
the user owns (an input of the build, a directory holding one, a file of theirs)."""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

from .errors import EagleExportError
from .files import is_dir, reading, replacing, resolved


def output_place(out_dir) -> Path:
    """`out_dir` resolved, once its nearest existing parent is known to be a directory this user may
    write in (a file, a link loop, a locked directory or a read-only file system there is named
    before any work: a file is created there and removed, which no permission bit can fake)."""
    out_dir = resolved(out_dir)
    above = next(d for d in (out_dir.parent, *out_dir.parents) if os.path.lexists(d))
    if not is_dir(above):
        raise EagleExportError(f"{above} is a file, not a directory: the output {out_dir} cannot go inside it",
                               "choose an output whose parent is a directory")
    try:
        with tempfile.TemporaryFile(dir=above):
            pass
    except OSError as e:
        raise EagleExportError(f"cannot write the output {out_dir} in {above} ({e.strerror or type(e).__name__})",
                               "choose an output place you can write to") from None
    return out_dir


def output_file(path) -> Path:
    """A file a command will write (--json, --report, --plot), checked before any work: its place as
    `output_place` checks it, and neither a directory in the file's place nor a file this user cannot
    write; returned resolved. A missing parent is no error: `write_output` makes it."""
    path = output_place(path)
    if is_dir(path):
        raise EagleExportError(f"{path} is a directory: the output file cannot replace it",
                               f"pass a file name, e.g. {path / 'out.json'}")
    if os.path.lexists(path):
        with reading(path, "choose another output file"):
            open(path, "ab").close()  # opened for writing, nothing written: permission and read-only named now
    return path


def output_directory(path) -> Path:
    """A directory a command will create (-o), checked before any work: its place as `output_place`
    checks it, and no file in its place."""
    out_dir = output_place(path)
    if os.path.lexists(out_dir) and not is_dir(out_dir):
        raise EagleExportError(f"{out_dir} is a file: the output directory cannot go in its place",
                               "choose another -o, or move that file away yourself")
    return out_dir


def made_parents(path) -> Path:
    """Path(path), its missing parent directories made (an output checked by `output_file`)."""
    path = Path(path)
    with reading(path.parent, "choose an output place you can write to"):
        path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_output(path, text: str | None = None, write=None) -> None:
    """Write an output file (a report, figures as JSON, a plot), making its missing parents: `text`, or
    what `write(temporary path)` writes. Written beside and renamed (`files.replacing`): a failure
    leaves the user's earlier file as it was, never half a file."""
    path = made_parents(path)
    with reading(path, "choose an output place you can write to"), replacing(path) as tmp:
        if write is None:
            tmp.write_text(text)
        else:
            write(tmp)


def check_output(out_dir: Path, replaceable, inputs=(), force: bool = False) -> list[str]:
    """Refuse an output that would destroy what the user owns; return warnings. `--force` replaces
    only what `replaceable` = (description, test) recognises as this tool's own output, never an
    input of the build or a directory holding one (`-o ''` is the current directory)."""
    for source in inputs:
        source = resolved(source)
        if out_dir == source or out_dir in source.parents:
            what = "is" if out_dir == source else f"holds {source}, which is"
            raise EagleExportError(f"the output {out_dir} {what} an input of this build",
                                   "choose an -o outside the checkpoints the build reads")
    if out_dir.exists() or out_dir.is_symlink():
        if not force:
            raise EagleExportError(f"{out_dir} already exists", "pass --force to replace it, or choose another -o")
        description, test = replaceable
        if not out_dir.is_dir() or not test(out_dir):
            raise EagleExportError(f"{out_dir} exists and is not {description}: --force replaces only those",
                                   "choose another -o, or move that directory away yourself")
    return [f"the output {out_dir} lies inside the input {source}: the checkpoint directory now holds a build"
            for source in map(resolved, inputs) if source in out_dir.parents]


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def sweep_leftovers(out_dir: Path) -> list[Path]:
    """Remove what a killed build (SIGKILL, power loss) left beside `out_dir`: `.NAME.partial-PID-*`
    of a dead process, and `.NAME.old-PID` (a replaced build) once `out_dir` exists again."""
    removed = []
    for kind in ("partial", "old"):
        prefix = f".{out_dir.name}.{kind}-"
        for path in out_dir.parent.glob(glob.escape(prefix) + "*"):
            pid = path.name[len(prefix):].split("-")[0]
            if not path.is_dir() or path.is_symlink() or not pid.isdigit() or _process_alive(int(pid)):
                continue
            if kind == "old" and not out_dir.is_dir():
                continue  # killed between its two renames: this may be the only copy of the old build
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _remove_empty(directories) -> None:
    """Remove these directories (deepest first) where still empty: those a failed build created."""
    for directory in directories:
        with contextlib.suppress(OSError):
            directory.rmdir()


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C, so the partial build is removed


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | Path, replaceable, force: bool = False, inputs=(), warn=None,
                      merge: bool = False):
    """Yield a temporary directory beside `out_dir`; rename it into place only if the body succeeds.

    A failure, Ctrl-C or SIGTERM removes the temporary directory, so no half build is ever left. An
    existing output is replaced only with `force`, only if it is this tool's own (`check_output`), and
    only once the new build is complete. Without `force` the final rename cannot replace a build that
    another process finished meanwhile (POSIX rename refuses a non-empty directory).
    `merge`: files go into a directory the user may keep other files in (`export -o`, `quantize -o`;
    the caller says what it may overwrite): once the body succeeds each file written is renamed into
    `out_dir` (made if missing), replacing its namesake, and nothing else there is touched."""
    out_dir = output_place(out_dir)
    for message in () if merge else check_output(out_dir, replaceable, inputs, force):
        (warn or print)(f"warning: {message}")
    parent = out_dir.parent
    created = [d for d in (parent, *parent.parents) if not os.path.lexists(d)]  # deepest first
    try:
        parent.mkdir(parents=True, exist_ok=True)
        sweep_leftovers(out_dir)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-{os.getpid()}-", dir=parent))
    except OSError as e:
        _remove_empty(created)
        raise EagleExportError(f"cannot write the output beside {out_dir} ({e.strerror})",
                               "choose an output directory you can write to (-o)") from None
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp's private 0700 would outlive the rename
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        yield tmp
        if merge:
            out_dir.mkdir(exist_ok=True)
            for path in sorted(tmp.iterdir()):
                os.replace(path, out_dir / path.name)
            tmp.rmdir()
        elif force and (out_dir.exists() or out_dir.is_symlink()):
            check_output(out_dir, replaceable, (), force)  # still ours, whatever happened meanwhile
            old = parent / f".{out_dir.name}.old-{os.getpid()}"
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.rename(tmp, out_dir)
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                    raise
                raise EagleExportError(f"{out_dir} appeared while this build ran (another build to the same -o "
                                       "finished first); it was kept and this build discarded",
                                       "pass --force to replace it, or choose another -o") from None
    except BaseException:  # includes KeyboardInterrupt and SIGTERM: the partial build goes, whatever stopped it
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)  # and the parent directories it made for the output
        raise
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
