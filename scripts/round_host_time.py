"""Host time of a device round with its graphs captured: the CPU's estimate of a GPU round's host time.

The device round (`runtime/device_round.py`) as it runs with CUDA graphs, on the CPU: the torch backend's
graphs and the round's bookkeeping captured through a stand-in (the tests' `replay_eagerly`) whose every
replay is timed; a call the backend runs eagerly (the prefill, a drafter call catching up over more than
K+1 rows) and the synthetic drafts' making (a measurement tool's work) are timed too. A round's host time
is the wall time from its start to the next round's start (the round loop's Python between them
included: should_draft, the loop's test, the emitted events' consumer) less its replays', eager calls'
and synthetic drafts' time: the Python of the round (emitting tokens, stop checks, statistics, timings,
the policy) and its torch calls outside the graphs (the read, copies, views). The read waits for nothing
here (the replays ran already): on a GPU its wait is the graphs' work, not host time.

Played back, not re-run: each cell is run once with replays that run the model (recording every replay's
outputs and every eager call's), then timed with replays that copy the recorded outputs into the graphs'
static outputs (and eager calls that return theirs): the same outputs in the same order, so the same
tokens (checked every run), statistics and policy decisions, while the host's caches stay the host
code's, as beside a GPU, whose replay is one launch. Replays that run the tiny model between the host's
steps evict its code and data from the CPU's caches and cost the host's work ~4x (a plain step's 45
against 220 us at batch 1 here): --eager times that way.

A tiny random-weight pair (the tests' qwen2 target and EAGLE-3.1 drafter, as scripts/k0_round_host_time.py),
K = --depth (4, the 8B kit's), greedy, the H200 bf16 cost curves for the goodput policy; at batch 1 and 4:
plain decoding, fixed K and goodput at synthetic acceptance 0.73/0.52/0.35/0.25 (vLLM CI's Llama-3.1-8B
EAGLE-3), goodput at acceptance 0 (its k = 0 rounds against the plain step). Each cell runs --repeat
times, the cells interleaved (a change of load touches every cell alike); a figure is the median over one
run's rounds of a kind (drafted, k = 0), then the median over the runs, and [min-max] of the runs'
medians. Each kind's replays a round are printed beside it: a GPU launches a replay in ~5-15 us, which
the figure does not hold (add replays x launch to compare with a GPU). This VM's cores are slower than a
GPU host's: the figure is the CPU's estimate of the GPU round's host time, not a GPU measurement.

Exposed and hidden: on a GPU what a round's host time costs is the part the device waits for. The
device is idle from a read's return until the next launch (the round's outputs read, the tokens
emitted, the policy told and asked, the next round's first launch), and in a goodput drafted round from
the read of its drafts until the verify call's launch (the choice): that host time is EXPOSED, and the
round's figure holds it from the previous round's read on (the boundary's work, before this round's
first launch, is what this round waits for). Between a launch and the next read the device works on
what was launched (the bookkeeping's replay, the policy's deferred `learn`, the read's own launch):
HIDDEN, as long as it is shorter than the device's work (at 8B it is). Launches are the replays and
eager graph calls, reads the `.tolist()` of the bookkeeping's output and of the drafts' read (the two
graphs `_replayed` runs); a read of a graph's outputs made any other way (none in the device round) is
not seen, and its time would count as hidden. The read's return includes its conversion to lists
(exposed, as on a GPU, where the transfer's latency adds more). The exposed figure is what item 3 of
issue 44 compares (a k = 0 round against a plain step) on what a GPU pays.

--against REV: the same cells with REV's package (extracted and imported beside the working tree's under
another name: its imports are relative) in turn with the working tree's, in one run, and whether their
tokens are identical. --profile: the top entries of a cProfile over the working tree's timed rounds
(replays, eager calls, synthetic drafts excluded), so the hot spots are named (--exposed: over their
exposed segments alone, what a GPU waits for).

Run: PYTHONPATH=. python scripts/round_host_time.py [--tokens 128] [--repeat 5] [--batch 1 4] [--depth 4]
     [--against REV] [--profile [--exposed] [--top 30]] [--eager]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import importlib.util
import io
import pstats
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_cuda_graphs import replay_eagerly  # noqa: E402
from tiny_models import write_tiny_drafter, write_tiny_target  # noqa: E402

REAL = (0.73, 0.52, 0.35, 0.25)
CELLS = [("plain", None, None), ("fixed", "fixed", REAL), ("goodput", "goodput", REAL), ("goodput", "goodput", 0.0)]


def package_at(rev: str, into: Path) -> str:
    """REV's eagle_export package, extracted under `into` and imported as eagle_export_at_<rev> (its imports
    are relative: it runs its own modules beside the working tree's) -> the package's name."""
    archive = subprocess.run(["git", "archive", rev, "eagle_export"], cwd=ROOT, check=True, capture_output=True).stdout
    tarfile.open(fileobj=io.BytesIO(archive)).extractall(into, filter="data")
    name = "eagle_export_at_" + "".join(c if c.isalnum() else "_" for c in rev)
    spec = importlib.util.spec_from_file_location(name, into / "eagle_export" / "__init__.py",
                                                  submodule_search_locations=[str(into / "eagle_export")])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return name


class Clock:
    """The seconds a round spends outside the graphs: replays (the capture stand-in's), eager graph calls and
    synthetic drafts are summed as they run (the profiler, if any, paused over them); each round's start
    marks (now, those sums, its kind). Recording (`tape` a list): each replay's outputs and each eager
    call's are kept in order; playing (`playing`): a replay copies the next recorded outputs into its
    static outputs and an eager call returns them, instead of running the model (see the module)."""

    def __init__(self):
        self.excluded, self.replays, self.eager, self.marks = 0.0, 0, 0, []
        # profiling: the profiler is on, outside the excluded calls (and, `exposed_only`, the hidden segments)
        self.profiler, self.profiling, self.exposed_only = None, False, False
        self.tape, self.playing, self.at = None, False, 0
        # exposed / hidden host seconds so far: the open segment (since `since`, `excluded` then `since_x`) is
        # exposed after a read (the device idle), hidden after a launch (the device working)
        self.split, self.idle, self.since, self.since_x = {True: 0.0, False: 0.0}, False, time.perf_counter(), 0.0

    def capture(self, fn, inputs, warmup=None):
        replay, outputs = replay_eagerly(fn, inputs, warmup)

        def timed():
            self.replays += 1
            self.timed(self._replayed, replay, outputs, launch=True)
        return timed, outputs

    def eager_call(self, graph):
        def call(*inputs):
            self.eager += 1
            return self.timed(self._called, graph, inputs, launch=True)
        return call

    def _segment(self, now: float, idle: bool) -> None:
        """Close the open segment at `now` into the exposed or hidden sum (less what was excluded in it),
        and open one that is exposed (`idle`: after a read) or hidden (after a launch)."""
        self.split[self.idle] += (now - self.since) - (self.excluded - self.since_x)
        self.idle, self.since, self.since_x = idle, now, self.excluded

    def read(self) -> None:
        """A read returned (its own time here excluded): the device idle from now until the next launch."""
        if self.profiling:
            self.profiler.disable()
        start = time.perf_counter()
        self._segment(start, True)
        self.excluded += time.perf_counter() - start
        if self.profiling:  # (an exposed segment opens)
            self.profiler.enable()

    def _replayed(self, replay, outputs):
        if self.playing:
            with torch.inference_mode():  # (a static output may be an inference tensor: the target's)
                for static, saved in zip(outputs, self._next()):
                    static.copy_(saved)
            return
        replay()
        if self.tape is not None:
            self.tape.append([t.clone() for t in outputs])

    def _called(self, graph, inputs):
        if self.playing:
            return tuple(t.clone() for t in self._next())
        out = graph(*inputs)
        if self.tape is not None:
            self.tape.append([t.clone() for t in out])
        return out

    def _next(self):
        self.at += 1
        return self.tape[self.at - 1]

    def timed(self, call, *args, launch=False):
        if self.profiling:
            self.profiler.disable()
        start = time.perf_counter()
        if launch:  # (the segment before it closes: the device works from this launch on)
            self._segment(start, False)
        out = call(*args)
        self.excluded += time.perf_counter() - start
        if self.profiling and (self.idle or not self.exposed_only):
            self.profiler.enable()
        return out

    def profile(self, on: bool):
        if self.profiler is not None and on != self.profiling:
            (self.profiler.enable if on and (self.idle or not self.exposed_only) else self.profiler.disable)()
            self.profiling = on

    def mark(self, drafted):
        self.marks.append((time.perf_counter(), self.excluded, self.replays, self.eager, drafted,
                           self.split[True], self.split[False]))

    def rounds(self):
        """(drafted, host seconds, replays, eager calls, exposed seconds, hidden seconds) of each marked round
        but the last (whose end is the stream's). Host is the wall time from the round's start to the next
        round's; exposed and hidden are the segments closed between the two marks: a round's first launch
        closes the exposed segment open since the previous round's read, so a round's exposed time is from
        that read on (see the module), and host and exposed + hidden differ by the boundary's share."""
        return [(d, (t1 - t0) - (x1 - x0), r1 - r0, e1 - e0, y1 - y0, h1 - h0)
                for (t0, x0, r0, e0, d, y0, h0), (t1, x1, r1, e1, _, y1, h1) in zip(self.marks, self.marks[1:])]


class Read:
    """A graph's output whose `.tolist()` is a read (the device round's bookkeeping output and its drafts'
    read): the clock is told when it returns."""

    def __init__(self, tensor, clock: Clock):
        self.tensor, self.clock = tensor, clock

    def tolist(self):
        rows = self.tensor.tolist()
        self.clock.read()
        return rows


def setup(package: str, tmp: Path, depth: int, tokens: int, clock: Clock, batches):
    """A runtime of `package` over the tiny pair, its graphs captured through `clock`, and each batch size's
    prompts and synthetic drafts (made before any timing: they run the runtime)."""
    mod = lambda name: importlib.import_module(f"{package}.{name}")  # noqa: E731
    checkpoint, unrolled, backends = mod("models.checkpoint"), mod("export.unrolled"), mod("runtime.backends")
    runtime_mod, replay, synthetic = mod("runtime.runtime"), mod("runtime.replay"), mod("speculation.synthetic")
    target = checkpoint.load_target(write_tiny_target(tmp / "t", "qwen2"), aux_layer_ids=(1, 3, 4))
    drafter = checkpoint.load_drafter(write_tiny_drafter(tmp / "d", "3.1"), target=target)
    backend = backends.TorchBackend(unrolled.TargetGraph(target, True), unrolled.UnrolledDrafter(drafter, depth, False),
                                    cuda_graphs=True, capture=clock.capture)
    for key, (graph, spec) in list(backend.graphs.items()):  # (the eager calls: the captured ones hold `graph`)
        backend.graphs[key] = clock.eager_call(graph), spec

    class Timed(runtime_mod.SpeculativeRuntime):
        def _round(self, state, live, policy=None, drafted=False):
            clock.mark(drafted)
            clock.profile(self.profiling)  # (from the first round on: not the prefill)
            yield from super()._round(state, live, policy, drafted)

        def _synthetic(self, state, parents, depths):
            return clock.timed(super()._synthetic, state, parents, depths)

        def _replayed(self, graphs, fn, feeds, warmup=None):  # (the two graphs whose output is read)
            out = super()._replayed(graphs, fn, feeds, warmup)
            return Read(out, clock) if graphs is self._settle_graphs or graphs is self._read_graphs else out

    runtime = Timed.for_models(backend, target, drafter, max_context=512, costs=replay.recorded_costs("H200 bf16"))
    runtime.profiling = False
    config = runtime_mod.GenerationConfig(max_new_tokens=tokens)
    streams = {}
    for batch in batches:
        prompts = [[1 + (7 * i + j) % 300 for j in range(12)] for i in range(batch)]
        continuations = synthetic.verify_width_continuations(runtime, prompts, config)
        streams[batch] = prompts, {a: synthetic.SyntheticDrafts(a if isinstance(a, tuple) else (a,) * depth,
                                                                continuations, runtime.vocab_size)
                                   for a in (REAL, 0.0)}
    return runtime, config, streams


def run_cell(runtime, clock, config, prompts, drafts, cell, tape=None, play=False, profile=False):
    """One run of a cell -> its rounds (drafted, host s, replays, eager calls) and its tokens; recording its
    graphs' outputs into `tape`, or (`play`) playing them back from it (each consumed)."""
    _, policy, acceptance = cell
    clock.marks, clock.tape, clock.playing, clock.at = [], tape, play, 0
    runtime.profiling = profile
    if policy is None:
        results = runtime.generate(prompts, config, speculative=False)
    else:
        drafts[acceptance].generator.manual_seed(0)  # (every run the same drafts)
        results = runtime.generate(prompts, config, verify_policy=policy, synthetic=drafts[acceptance])
    clock.profile(False)
    clock.mark(None)
    if play and clock.at != len(tape):
        raise RuntimeError(f"the played run made {clock.at} graph calls, the recorded one {len(tape)}")
    clock.tape, clock.playing = None, False
    return clock.rounds(), [r.tokens for r in results]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--against", help="a commit whose package runs the same cells in turn with the working tree's")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the working tree's timed rounds")
    parser.add_argument("--exposed", action="store_true", help="with --profile: of their exposed segments only")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--eager", action="store_true",
                        help="time rounds whose replays run the model (not played back from a recording)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        packages = {"new": "eagle_export"}
        if args.against:
            packages = {"old": package_at(args.against, tmp / "old"), **packages}
        sides = {}
        for key, package in packages.items():
            clock = Clock()
            sides[key] = clock, *setup(package, tmp / key, args.depth, args.tokens, clock, args.batch)
        # warm: every cell once (the graphs of every shape captured), then recorded (nothing timed)
        tokens, tapes = {}, {}
        for key, (clock, runtime, config, streams) in sides.items():
            for batch in args.batch:
                for cell in CELLS:
                    run_cell(runtime, clock, config, *streams[batch], cell)
                    tapes[key, batch, cell] = []
                    tokens[key, batch, cell] = run_cell(runtime, clock, config, *streams[batch], cell,
                                                        tapes[key, batch, cell])[1]
        if args.against:
            differ = [f"batch {b} {c[0]} {c[2]}" for (k, b, c) in tokens if k == "new" and tokens["old", b, c] != tokens[k, b, c]]
            print("tokens: " + ("identical, old and new, in every cell" if not differ else "DIFFER in " + ", ".join(differ)))

        def timed_run(key, batch, cell, profile=False):
            clock, runtime, config, streams = sides[key]
            rounds, got = run_cell(runtime, clock, config, *streams[batch], cell,
                                   None if args.eager else tapes[key, batch, cell], play=not args.eager,
                                   profile=profile)
            if got != tokens[key, batch, cell]:
                raise RuntimeError(f"batch {batch} {cell}: a timed run's tokens are not the recorded run's")
            return rounds

        got = {(key, batch, cell): [] for key in sides for batch in args.batch for cell in CELLS}
        for _ in range(args.repeat):
            for batch in args.batch:
                for cell in CELLS:
                    for key in sides:
                        got[key, batch, cell].append(timed_run(key, batch, cell))
        profile = None
        if args.profile:
            sides["new"][0].profiler = profile = cProfile.Profile()
            sides["new"][0].exposed_only = args.exposed
            for _ in range(args.repeat):
                for batch in args.batch:
                    for cell in CELLS:
                        timed_run("new", batch, cell, profile=True)
            sides["new"][0].profiler = None

    how = "replays that run the model (--eager)" if args.eager else "replays played back from a recorded run"
    print(f"tiny qwen2 pair, torch CPU, graphs captured by a stand-in, {how}, K={args.depth}, {args.tokens} tokens, "
          f"H200 bf16 costs; host us per round (wall less replays, eager calls, synthetic drafts), split into "
          "exposed (the device idle: from the previous read to the first launch, and from the drafts' read to the "
          f"verify launch) and hidden (from a launch to the next read): median of {args.repeat} runs (each the "
          "median of its rounds) [min-max of the runs]; replays a round beside it (a GPU adds ~5-15 us of launch "
          "each, exposed for the first launch and the verify launch)")
    print("| batch | policy | acceptance | side | drafted rounds | host us, drafted | exposed | hidden | replays "
          "| k = 0 rounds | host us, k = 0 | exposed | hidden | replays |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def figure(kinds, at: int, digits: int, spread: bool = True) -> str:  # the median over runs of each run's median
        medians = [statistics.median(r[at] for r in rounds) * 1e6 for rounds in kinds]
        return f"{statistics.median(medians):.{digits}f}" + (
            f" [{min(medians):.{digits}f}-{max(medians):.{digits}f}]" if spread else "")

    for batch in args.batch:
        for cell in CELLS:
            for key in sides:
                runs = got[key, batch, cell]
                cells = []
                for drafted in (True, False):
                    kinds = [[r for r in run if bool(r[0]) is drafted] for run in runs]
                    if not kinds[0] or not all(kinds):
                        cells += ["0", "-", "-", "-", "-"]
                        continue
                    replays = statistics.median(r[2] for r in kinds[0])
                    cells += [f"{len(kinds[0])}", figure(kinds, 1, 0), figure(kinds, 4, 1), figure(kinds, 5, 1, False),
                              f"{replays:g}"]
                name, _, acceptance = cell
                acc = "-" if acceptance is None else ("/".join(map(str, acceptance)) if isinstance(acceptance, tuple)
                                                      else str(acceptance))
                print(f"| {batch} | {name} | {acc} | {key} | " + " | ".join(cells) + " |")
    if profile is not None:
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
        print(out.getvalue())


if __name__ == "__main__":
    main()
