"""The user cache, and the one reader and writer of every cache this tool keeps: the measured costs
(`costs.json` in a build, or `costs/` here for a read-only build), the conformance results
(`conformance/`) and the sample target's conversion marker. (The prompt sets extracted into `data/`
are checked against their archive by data.prompts; `downloads/` holds archives pip wrote.)

The user cache is `EAGLE_EXPORT_CACHE` when set, else `$XDG_CACHE_HOME/eagle-export`, else
`~/.cache/eagle-export`.

A cache is what an earlier run measured, never an input: one that cannot be read, is not JSON, is
cut short, is nested deeper than its writer writes, or does not match its schema (a list for an
object, a string for a time, a zero or negative or NaN time, a width missing) is worth nothing, so
`read_cache` says so in one line ("<file>: ignored and measured again: <why>") and the caller measures
again; it never raises and never refuses. `write_cache` writes by rename, removes its temporary file
when the write fails (a full disk, a directory in the file's place, permission) and says in one line
that the cache was not saved and why. A schema is a small tree of the checkers below (`Record`,
`Map`, `List`, `Number`, ...): each states the JSON it accepts, and the message names the first value
outside it by its place in the file.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from .files import replacing

MAX_CACHE_BYTES = 16 << 20  # no cache this tool writes comes near this; a larger file is not read whole
TEMPORARY = "{name}.[a-z0-9_]{{8}}.tmp"  # write_cache's temporary file beside `name` (mkstemp's 8 characters)


def cache_root() -> Path:
    if os.environ.get("EAGLE_EXPORT_CACHE"):
        return Path(os.environ["EAGLE_EXPORT_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "eagle-export"


class Invalid(Exception):
    """A cache value outside its schema: the message says where and what was expected."""


def _shown(value) -> str:
    text = json.dumps(value) if isinstance(value, (int, float, str, bool)) or value is None else type(value).__name__
    return {"dict": "an object", "list": "a list"}.get(text, text[:40])


def _at(where: str, key) -> str:
    return f"{where}.{key}" if where else str(key)


@dataclass(frozen=True)
class Number:
    """A finite JSON number (not a boolean) in [low, high], above `low` when `above`; whole when `whole`."""
    low: float = -math.inf
    high: float = math.inf
    above: bool = False
    whole: bool = False

    def __call__(self, value, where: str):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
            value > self.low if self.above else value >= self.low) and value <= self.high and (
            not self.whole or float(value).is_integer())
        if not ok:
            kind = "a whole number" if self.whole else "a number"
            low = f"above {self.low:g}" if self.above else f"from {self.low:g}" if self.low > -math.inf else ""
            span = " ".join(p for p in (low, f"to {self.high:g}" if self.high < math.inf else "") if p)
            raise Invalid(f"{where or 'the file'} is {_shown(value)}, expected {kind}{' ' + span if span else ''}")


@dataclass(frozen=True)
class Text:
    max_len: int = 1 << 16

    def __call__(self, value, where: str):
        if not isinstance(value, str) or len(value) > self.max_len:
            raise Invalid(f"{where or 'the file'} is {_shown(value)}, expected a string")


@dataclass(frozen=True)
class Const:
    value: object

    def __call__(self, value, where: str):
        if value != self.value or type(value) is not type(self.value):
            raise Invalid(f"{where or 'the file'} is {_shown(value)}, expected {_shown(self.value)}")


@dataclass(frozen=True)
class Either:
    options: tuple

    def __call__(self, value, where: str):
        problems = []
        for option in self.options:
            try:
                return option(value, where)
            except Invalid as e:
                problems.append(str(e).split(", expected ")[-1])
        raise Invalid(f"{where or 'the file'} is {_shown(value)}, expected {' or '.join(problems)}")


NULL, FLAG = Const(None), Either((Const(True), Const(False)))


@dataclass(frozen=True)
class List:
    item: object
    min_len: int = 0
    max_len: int = 1 << 16

    def __call__(self, value, where: str):
        if not isinstance(value, list) or not self.min_len <= len(value) <= self.max_len:
            count = (f"{self.min_len}" if self.min_len == self.max_len
                     else f"{self.min_len} to {self.max_len}" if self.max_len < 1 << 16 else f"{self.min_len} or more")
            raise Invalid(f"{where or 'the file'} is {_shown(value)}"
                          f"{f' of {len(value)}' if isinstance(value, list) else ''}, expected a list of {count}")
        for i, item in enumerate(value):
            self.item(item, f"{where}[{i}]")


@dataclass(frozen=True)
class Record:
    """An object with these keys (more are allowed and ignored: nothing reads them)."""
    fields: dict

    def __call__(self, value, where: str):
        if not isinstance(value, dict):
            raise Invalid(f"{where or 'the file'} is {_shown(value)}, expected an object")
        for key, check in self.fields.items():
            if key not in value:
                raise Invalid(f"{_at(where, key)} is missing")
            check(value[key], _at(where, key))


@dataclass(frozen=True)
class Map:
    """An object of any keys matching `key` (a Text, or a Number for whole numbers written as keys)."""
    key: object
    value: object
    max_items: int = 1 << 16

    def __call__(self, value, where: str):
        if not isinstance(value, dict) or len(value) > self.max_items:
            raise Invalid(f"{where or 'the file'} is {_shown(value)}, expected an object of at most "
                          f"{self.max_items} {'entry' if self.max_items == 1 else 'entries'}")
        for key, item in value.items():
            if isinstance(self.key, Number):
                if not re.fullmatch(r"-?[0-9]{1,9}", key):
                    raise Invalid(f"{_at(where, json.dumps(key)[:40])} is not a whole number")
                self.key(int(key), f"key {_at(where, key)}")
            else:
                self.key(key, f"a key of {where or 'the file'}")
            self.value(item, _at(where, key))


def _why(error: OSError) -> str:
    return {errno.EISDIR: "a directory is in its place", errno.ENOSPC: "no space left on the device",
            errno.EDQUOT: "the disk quota is exceeded", errno.EACCES: "permission denied",
            errno.EPERM: "permission denied", errno.EROFS: "a read-only file system",
            errno.ELOOP: "a symbolic link loop"}.get(error.errno, error.strerror or type(error).__name__).lower()


def say(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)


def read_cache(path: Path, schema, again: str = "measured again", report: bool = True):
    """The cache at `path` if it is there and matches `schema`; else None (one line on stderr, unless
    `report` is off, when it is there but unusable)."""
    if not os.path.lexists(path):
        return None
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):  # a FIFO would block the read
            raise Invalid("a directory is in its place" if stat.S_ISDIR(mode) else "not a regular file")
        with open(path, "rb") as f:
            data = f.read(MAX_CACHE_BYTES + 1)
        if len(data) > MAX_CACHE_BYTES:
            raise Invalid(f"larger than {MAX_CACHE_BYTES >> 20} MiB")
        value = json.loads(data.decode("utf-8"))
        schema(value, "")
        return value
    except OSError as e:
        why = f"it cannot be read ({_why(e)})"
    except RecursionError:
        why = "nested deeper than any cache"
    except ValueError as e:  # not UTF-8, not JSON, cut short
        why = f"not valid JSON ({str(e)[:80]})"
    except Invalid as e:
        why = str(e)
    if report:
        say(f"{path}: ignored and {again}: {why}")
    return None


def write_cache(path: Path, data, again: str = "measured again") -> bool:
    """Write `data` as JSON to `path` by rename (readers see the old file or the new one, never half);
    False (one line on stderr, no temporary file left) when it cannot be written."""
    try:
        write_bytes_atomic(path, (json.dumps(data, indent=1) + "\n").encode())
        return True
    except OSError as e:
        fix = f" (remove {path} to keep it)" if e.errno == errno.EISDIR else ""
        say(f"{path}: not saved ({_why(e)}): it will be {again} next time{fix}")
        return False


def write_bytes_atomic(path: Path, content: bytes) -> None:
    """`content` into `path` by rename (`files.replacing`), its parents made; on any failure the
    temporary file is removed and the OSError raised."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        tmp.write_bytes(content)


def is_temporary(name: str, cache_name: str) -> bool:
    """Whether `name` is a temporary file of `write_cache` for `cache_name` (left only by a process
    killed mid-write): never read by anything, so no reason to refuse what holds it."""
    return re.fullmatch(TEMPORARY.format(name=re.escape(f".{cache_name}")), name) is not None
