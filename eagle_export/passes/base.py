"""The shape every pass takes, at the torch level and the ONNX level alike.

Modelled on onnx_ir.passes: a pass is a callable object with a name and a docstring that
states the rewrite and why it is exact. Calling it returns a PassResult saying whether it
changed anything and what (counts for the build manifest). A pass whose precondition does
not hold is a no-op that says why (``skipped``), never an error: running `fold_fc_norm` on an
EAGLE-3 drafter is a normal part of a pipeline. A postcondition that fails *is* an error,
because it means the pass itself is wrong.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


class PostconditionError(RuntimeError):
    """A pass left the model in a state its own contract forbids (a bug in the pass)."""


@dataclass
class PassResult:
    model: Any
    modified: bool
    changes: dict[str, int] = field(default_factory=dict)  # e.g. nodes_removed, bytes_saved
    skipped: str | None = None  # why the pass did not apply, when it did not


class PassBase:
    """Subclasses set `name`, write a docstring, and implement `call`; `requires` and
    `ensures` are optional pre- and postconditions."""

    name: str = ""

    def requires(self, model: Any) -> str | None:
        """Return the reason this pass does not apply to `model`, or None when it does."""
        return None

    def ensures(self, model: Any) -> None:
        """Raise PostconditionError when `model` breaks this pass's contract."""

    def call(self, model: Any) -> PassResult:
        raise NotImplementedError

    def __call__(self, model: Any) -> PassResult:
        reason = self.requires(model)
        if reason is not None:
            return PassResult(model, modified=False, skipped=reason)
        result = self.call(model)
        self.ensures(result.model)
        return result

    @property
    def summary(self) -> str:
        """First line of the docstring: what `eagle-export passes` prints."""
        return (self.__doc__ or "").strip().splitlines()[0] if self.__doc__ else ""


@dataclass
class PassRecord:
    """What one pass did in a pipeline run, as the build manifest stores it."""

    name: str
    modified: bool
    changes: dict[str, int]
    skipped: str | None
    seconds: float

    def to_json(self) -> dict:
        return {"name": self.name, "modified": self.modified, "changes": self.changes,
                "skipped": self.skipped, "seconds": round(self.seconds, 4)}


@dataclass
class PipelineResult:
    model: Any
    records: list[PassRecord]

    @property
    def modified(self) -> bool:
        return any(r.modified for r in self.records)


class PassManager:
    """Runs passes in order and records what each did."""

    def __init__(self, passes: list[PassBase]):
        self.passes = list(passes)

    def __call__(self, model: Any) -> PipelineResult:
        records = []
        for p in self.passes:
            start = time.perf_counter()
            result = p(model)
            model = result.model
            records.append(PassRecord(p.name, result.modified, dict(result.changes),
                                      result.skipped, time.perf_counter() - start))
        return PipelineResult(model, records)
