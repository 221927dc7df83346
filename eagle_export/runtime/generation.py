"""A request's generation settings, checked where the CLI and the Python API both pass.

Its own module, free of torch and numpy (their scalars are `numbers.Integral` / `numbers.Real`): the
command line checks `--max-new-tokens`, `--temperature` and `--top-p` before it imports the runtime,
so a usage error answers at once."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from ..errors import EagleExportError


def is_int(value) -> bool:
    """A whole number as Python or numpy holds it; bool is refused although it subclasses int."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy, lossless against target-only greedy decoding
    top_p: float = 1.0
    eos_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self):
        """Refuse nonsense here, where the CLI and the Python API both pass: NaN or a negative
        temperature would decode greedily, an empty stop string would stop after one token."""
        def number(value) -> bool:
            return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise EagleExportError(f"max_new_tokens is {self.max_new_tokens!r}", "pass a whole number of 1 or more")
        if not number(self.temperature) or self.temperature < 0:
            raise EagleExportError(f"temperature is {self.temperature!r}",
                                   "pass 0 for greedy decoding or a finite positive number to sample")
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            raise EagleExportError(f"top_p is {self.top_p!r}, outside (0, 1]", "pass a top_p above 0 and at most 1")
        if isinstance(self.eos_ids, (str, bytes)) or not all(is_int(i) and i >= 0 for i in self.eos_ids):
            raise EagleExportError(f"eos_ids {self.eos_ids!r} are not token ids", "pass a tuple of ids of 0 or more")
        if isinstance(self.stop_strings, (str, bytes)):
            raise EagleExportError(f"stop_strings is the single string {self.stop_strings!r}, read as its characters",
                                   "pass a tuple of strings, e.g. stop_strings=(\"###\",)")
        if not all(isinstance(stop, str) and stop for stop in self.stop_strings):
            raise EagleExportError(f"stop_strings {self.stop_strings!r} holds an empty string or a non-string "
                                   "(an empty string is found at once)", "pass non-empty strings only")
        if not is_int(self.seed):
            raise EagleExportError(f"seed is {self.seed!r}", "pass a whole number")
