"""The torch backend's static-cache mode and CUDA graphs: lossless on CPU, the graph bookkeeping on
CPU through a capture that replays eagerly into the same static buffers, the real capture on CUDA."""

import pytest
import torch
from random_policy import RandomDepth
from test_runtime import PROMPTS, PlantedDrafts, drafter, make_runtime, target  # noqa: F401 (fixtures)

from eagle_export.errors import EagleExportError
from eagle_export.export.unrolled import TargetGraph, UnrolledDrafter
from eagle_export.models import contract as C
from eagle_export.runtime.backends import TorchBackend
from eagle_export.runtime.cuda_graphs import ShapeGraphs
from eagle_export.runtime.runtime import GenerationConfig, SpeculativeRuntime

pytestmark = pytest.mark.usefixtures("no_grad")


def replay_eagerly(fn, inputs, warmup=None):
    """A stand-in for a CUDA graph on CPU: static inputs and outputs as captured, a replay that
    recomputes from the static inputs and copies into the outputs the capture returned (an output that
    is one of the inputs is that tensor, as in a CUDA graph). As a CUDA capture records without running,
    the outputs are made by a warm-up call (on `warmup`, if given). A replay records nothing for autograd,
    as a CUDA graph's: it runs in inference mode (its static outputs may be inference tensors, made by a
    capture in inference mode, and a steady-state call replays outside it: `TorchBackend._run`)."""
    outputs = tuple(fn(*(inputs if warmup is None else warmup)))

    def replay():
        with torch.inference_mode():
            for static, fresh in zip(outputs, fn(*inputs)):
                if static is not fresh:
                    static.copy_(fresh)
    return replay, outputs


def keys(backend):
    return {name: backend.captured[graph].keys() for name, graph in (("target", None), ("drafter", False))}


# ------------------------------------------------------------ the bookkeeping, on a toy function

def test_inputs_are_copied_into_static_buffers_and_bound_ones_are_read_in_place():
    captures = []

    def capture(fn, inputs, warmup=None):
        captures.append(inputs)
        return replay_eagerly(fn, inputs, warmup)

    graphs = ShapeGraphs(lambda x, cache: (x * 2 + cache.sum(),), ["x", "cache"], ("cache",), capture)
    cache = torch.zeros(3)
    first = graphs({"x": torch.ones(2), "cache": cache})[0]
    assert first.tolist() == [2, 2]
    cache += 1  # the runtime writes its cache between replays: the graph sees it without a copy
    second = graphs({"x": torch.full((2,), 5.0), "cache": cache})[0]
    assert second is first and second.tolist() == [13, 13]  # one static output, overwritten by the replay
    assert len(captures) == 1 and captures[0][1] is cache and graphs.copied_bound == 0
    graphs({"x": torch.ones(2), "cache": torch.full((3,), 2.0)})  # another cache tensor: copied in, still right
    assert first.tolist() == [8, 8] and graphs.copied_bound == 1
    graphs({"x": torch.ones(4), "cache": cache})  # a new shape: its own graph
    assert len(captures) == 2 and graphs.keys() == {(2,), (4,)}
    x = torch.ones(4)
    out = graphs({"x": x, "cache": cache})[0]
    x += 1  # the same input tensor, written in place: copied in again (only its shapes are known)
    assert graphs({"x": x, "cache": cache})[0].tolist() == [10, 10, 10, 10] and out.tolist() == [10, 10, 10, 10]


def _bound_never_copied(self, inputs, given, refs):  # planted: a bound input given as another tensor is read stale
    for static, tensor, ref in zip(inputs, given, refs):
        if not ref and static is not tensor:
            static.copy_(tensor)


def _binding_ignored(original):  # planted: the caller's bound names dropped, its buffers copied in every call
    return lambda self, feeds, bound=(), into=(): original(self, feeds, (), into)


@pytest.mark.parametrize("plant", [None, _bound_never_copied, _binding_ignored],
                         ids=["bound", "planted: not copied in", "planted: binding ignored"])
def test_a_callers_own_buffers_are_bound_in_graphs_of_their_own(monkeypatch, plant):
    """A caller that keeps its inputs at fixed addresses binds them (`bound`): the graph is captured over
    its tensors and reads them in place, nothing copied; another caller's fresh tensors of the same shapes
    replay a graph of their own, with clones, and never write the first caller's buffers; a bound input
    given as another tensor of its layout is copied in (counted), one of another layout (a regrown
    buffer's view) gets a graph of its own. Planted: a bound input replaced between calls but not copied
    in; the caller's binding ignored (its buffers copied in at every call)."""
    if plant is _bound_never_copied:
        monkeypatch.setattr(ShapeGraphs, "_feed", plant)
    elif plant is _binding_ignored:
        monkeypatch.setattr(ShapeGraphs, "__call__", plant(ShapeGraphs.__call__))
    captures = []

    def capture(fn, inputs, warmup=None):
        captures.append(inputs)
        return replay_eagerly(fn, inputs, warmup)

    graphs = ShapeGraphs(lambda x, n, cache: (x * n + cache.sum(),), ["x", "n", "cache"], ("cache",), capture)
    cache, x, n = torch.zeros(3), torch.ones(2), torch.full((2,), 2.0)
    mine = {"x": x, "n": n, "cache": cache}
    assert graphs(mine, ("x", "n"))[0].tolist() == [2, 2]
    x.fill_(3)  # the caller writes its buffer between calls
    assert graphs(mine, ("x", "n"))[0].tolist() == [6, 6]
    assert graphs({"x": torch.full((2,), 5.0), "n": torch.ones(2), "cache": cache})[0].tolist() == [5, 5]
    assert x.tolist() == [3, 3] and n.tolist() == [2, 2]  # (another caller's call wrote nothing of the first's)
    in_place = captures[0][0] is x and captures[0][1] is n  # (the same tensors: nothing to copy in, `_feed`)
    if plant is _binding_ignored:
        assert not in_place
        return
    assert in_place and len(captures) == 2
    other = torch.full((2,), 4.0)  # the caller's buffer replaced by another of its layout
    result = graphs({"x": other, "n": n, "cache": cache}, ("x", "n"))[0].tolist()
    if plant is _bound_never_copied:
        assert result != [8, 8]
        return
    assert result == [8, 8] and graphs.copied_bound == 1 and len(captures) == 2
    strided = torch.full((2, 2), 7.0)[:, 0]  # another layout: a graph of its own, read in place
    assert graphs({"x": strided, "n": n, "cache": cache}, ("x", "n"))[0].tolist() == [14, 14]
    assert len(captures) == 3 and captures[2][0] is strided and graphs.copied_bound == 1


def _epilogue_skipped(original):  # planted: the copies `into` not captured with the call
    return lambda self, key, given, refs, into: (*original(self, key, given, refs, ())[:3], [d for _, d in into])


@pytest.mark.parametrize("plant", [None, _epilogue_skipped], ids=["into", "planted: epilogue skipped"])
def test_outputs_written_into_a_callers_tensors_are_copied_inside_the_graph(monkeypatch, plant):
    """A call's `into` ((output name, destination), ...): the graph copies the output into the caller's tensor
    (a strided view of its buffer here) at every replay, the copy captured after the function's work (the
    fake capture replays it: no copy of the host's); a graph of its own beside the one without (a call
    without `into` writes nothing of the caller's); another destination of the same layout is copied out of
    the captured one (counted); a name that is no output is refused. Planted: the copy not captured."""
    if plant is not None:
        monkeypatch.setattr(ShapeGraphs, "_capture", plant(ShapeGraphs._capture))
    graphs = ShapeGraphs(lambda x, cache: (x * 2 + cache.sum(), x + 1), ["x", "cache"], ("cache",), replay_eagerly,
                         output_names=["y", "z"])
    cache, x, buffer = torch.zeros(3), torch.ones(2), torch.zeros(2, 3)
    into = (("z", buffer[:, 1]),)
    graphs({"x": x, "cache": cache}, into=into)
    x.fill_(4)
    graphs({"x": x, "cache": cache}, into=into)
    if plant is not None:
        assert buffer[:, 1].tolist() != [5, 5]
        return
    assert buffer.tolist() == [[0, 5, 0], [0, 5, 0]]
    assert graphs({"x": torch.full((2,), 7.0), "cache": cache})[1].tolist() == [8, 8]  # (its own graph)
    assert buffer.tolist() == [[0, 5, 0], [0, 5, 0]] and len(graphs.graphs) == 2
    other = torch.zeros(2, 3)
    graphs({"x": x, "cache": cache}, into=(("z", other[:, 1]),))
    assert other[:, 1].tolist() == [5, 5] and graphs.copied_bound == 1 and len(graphs.graphs) == 2
    with pytest.raises(ValueError, match="not outputs"):
        graphs({"x": x, "cache": cache}, into=(("w", other[:, 1]),))


@pytest.mark.parametrize("by_address", [True, False], ids=["by address", "planted: copied in"])
def test_a_function_writing_its_bound_inputs_gets_a_graph_per_buffer(by_address):
    """A function that writes its bound inputs in place (a device round's bookkeeping) keys its graphs by
    their addresses too: another buffer of the same layout gets a graph of its own, and the writes land in
    the caller's buffer. Planted: such a buffer copied in, the writes land in the captured one."""
    def advance(step, total):
        total.add_(step)
        return (total * 1,)

    graphs = ShapeGraphs(advance, ["step", "total"], ("step", "total"), replay_eagerly,
                         warmup=lambda inputs: [torch.zeros_like(inputs[0]), inputs[1]], by_address=by_address)
    step, first, second = torch.ones(2), torch.zeros(2), torch.zeros(2)
    graphs({"step": step, "total": first})
    graphs({"step": step, "total": second})
    assert first.tolist() == [1, 1]
    assert (second.tolist() == [1, 1]) is by_address and (len(graphs.graphs) == 2) is by_address


@pytest.mark.parametrize("recent", [16, 1], ids=["recent sets", "planted: the last set only"])
def test_sets_of_inputs_seen_lately_are_replayed_without_looking_at_their_shapes(monkeypatch, recent):
    """A stream alternates verify widths (goodput's j, its k = 0 rounds): each width's inputs are the same
    tensors every round, so a call with a set seen among the last RECENT skips the shape lookup (a torch
    call per input, host time in every round) and still replays its own graph. Planted: only the last
    set remembered, so alternating widths look their shapes up every call."""
    from torch.overrides import TorchFunctionMode

    import eagle_export.runtime.cuda_graphs as cuda_graphs

    class Shapes(TorchFunctionMode):
        seen = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Shapes.seen += getattr(func, "__name__", "") == "__get__"  # (a tensor's shape, read)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(cuda_graphs, "RECENT", recent)
    cache = torch.zeros(3)
    graphs = ShapeGraphs(lambda x, cache: (x * 2 + cache.sum(),), ["x", "cache"], ("cache",), replay_eagerly)
    widths = {n: torch.ones(n) for n in (1, 2, 4)}
    for n in widths:  # captured
        graphs({"x": widths[n], "cache": cache})
    with Shapes():
        for n in (1, 4, 2, 1, 2, 4):
            widths[n].fill_(n)
            assert graphs({"x": widths[n], "cache": cache})[0].tolist() == [2.0 * n] * n
    assert (Shapes.seen > 0) is (recent == 1), Shapes.seen


@pytest.mark.parametrize("warmup", [True, False], ids=["dry warm-up", "planted: warm-up on the real inputs"])
def test_a_function_that_writes_its_inputs_warms_up_on_inputs_it_leaves_unchanged(warmup):
    """A capture runs its function before it records it; a function that writes its inputs in place (a
    device round's bookkeeping) names warm-up inputs under which it writes nothing, so each call applies
    it once. Planted: warmed up on the real inputs, the first call applies it twice."""
    def advance(step, total):
        total.add_(step)
        return (total * 1,)

    total = torch.zeros(2)
    graphs = ShapeGraphs(advance, ["step", "total"], ("step", "total"), replay_eagerly,
                         warmup=(lambda inputs: [torch.zeros_like(inputs[0]), inputs[1]]) if warmup else None)
    step = torch.ones(2)
    graphs({"step": step, "total": total})
    graphs({"step": step, "total": total})
    assert (total.tolist() == [2, 2]) is warmup


def test_a_capture_that_fails_is_a_clear_error():
    def capture(fn, inputs, warmup=None):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    graphs = ShapeGraphs(lambda x: (x,), ["x"], (), capture)
    with pytest.raises(EagleExportError, match="CUDA graph capture failed .* not permitted") as e:
        graphs({"x": torch.ones(2)})
    assert "--no-cuda-graphs" in e.value.fix


def test_cuda_graphs_need_a_cuda_device_and_static_caches(target, drafter):
    with pytest.raises(EagleExportError, match="need a CUDA device") as e:
        make_runtime(target, drafter, 2, cuda_graphs=True)
    assert "--cuda-graphs" in e.value.fix
    with pytest.raises(EagleExportError, match="need static caches"):
        make_runtime(target, drafter, 2, cuda_graphs=True, capture=replay_eagerly, static_cache=False)


# ------------------------------------------------------------ static caches and fixed widths, lossless

@pytest.mark.parametrize("graphs", [False, True], ids=["static", "static+graphs"])
@pytest.mark.parametrize("batch", [1, 2])
def test_static_mode_is_lossless_and_keeps_one_cache_per_batch_size(target, drafter, batch, graphs):
    depth, max_context = 3, 96
    kw = {"cuda_graphs": True, "capture": replay_eagerly} if graphs else {}
    runtime = make_runtime(target, drafter, depth, max_context=max_context, static_cache=True, **kw)
    prompts = PROMPTS[:batch]
    first_caches = None
    for round_ in range(2):  # the second call reuses the first's caches (stale rows masked)
        results = runtime.generate(prompts, GenerationConfig(max_new_tokens=24))
        assert [r.tokens for r in results] == [target.generate_greedy(p, 24) for p in prompts]
        autoregressive = runtime.generate(prompts, GenerationConfig(max_new_tokens=24), speculative=False)
        assert [r.tokens for r in autoregressive] == [r.tokens for r in results]
        caches = runtime._static_caches[batch]
        assert all(c.shape[3] == max_context for c in caches)
        assert round_ == 0 or all(a is b for a, b in zip(caches, first_caches))
        first_caches = caches
    if graphs:
        # The goodput policy measured every width: one graph per verify width, one for the drafter's K+1 rows.
        assert keys(runtime.backend) == {"target": {(batch, t) for t in range(1, depth + 2)},
                                         "drafter": {(batch, depth + 1)}}
        for graph in runtime.backend.captured.values():
            for inputs, *_ in graph.graphs.values():  # caches bound by reference, never copied
                bound = [inputs[graph.input_names.index(name)] for name in (C.PAST_KEY, C.PAST_VALUE)]
                assert {t.data_ptr() for t in bound} <= {c.data_ptr() for c in first_caches}
            assert graph.copied_bound == 0
        # The device round's verify calls read the runtime's buffers in place; the cost measurement's calls of
        # the same widths (fresh tensors) replayed graphs of their own.
        buffers, verify = runtime._round_buffers[batch], runtime.backend.captured[None]
        ids = verify.input_names.index(C.INPUT_IDS)
        in_place = [inputs[ids].shape[1] for inputs, *_ in verify.graphs.values()
                    if inputs[ids].data_ptr() == buffers.verify_ids.data_ptr()]
        assert in_place and len(verify.graphs) == depth + 1 + len(in_place)


def test_static_caches_are_seen_through_views_growing_in_power_of_two_buckets(target, drafter):
    """A sequence crossing 256 slots: the calls see views of 256, then 512 slots of the same memory
    (never all 1024), one graph per (width, view size), and the output stays the target's own."""
    depth, prompt = 3, [(7 * i) % 200 + 1 for i in range(240)]
    runtime = make_runtime(target, drafter, depth, max_context=1024, cuda_graphs=True, capture=replay_eagerly,
                           verify_policy="fixed")
    [result] = runtime.generate([prompt], GenerationConfig(max_new_tokens=24))
    assert result.tokens == target.generate_greedy(prompt, 24)
    graphs = runtime.backend.captured[None]
    past = graphs.input_names.index(C.PAST_KEY)
    assert {inputs[past].shape[3] for inputs, *_ in graphs.graphs.values()} == {256, 512}
    full = runtime._static_caches[1][0]
    assert full.shape[3] == 1024 and all(inputs[past].data_ptr() == full.data_ptr()
                                         for inputs, *_ in graphs.graphs.values())
    assert graphs.copied_bound == 0


@pytest.mark.parametrize("batch", [1, 3])
def test_graphs_survive_any_depth_and_catch_up_calls(target, drafter, batch):
    """A random policy (plain steps, so the drafter catches up on more than K+1 rows, which run
    eagerly; every k) with drafts that are mostly right: every commit and rollback, against graphs."""
    depth = 4
    prompts = PROMPTS[:batch]
    expected = [p + target.generate_greedy(p, 40) for p in prompts]
    policy = RandomDepth(depth, seed=batch)
    runtime = make_runtime(target, drafter, depth, backend_cls=PlantedDrafts, continuations=expected,
                           error_rate=0.3, seed=batch, verify_policy=policy, cuda_graphs=True, capture=replay_eagerly)
    results = runtime.generate(prompts, GenerationConfig(max_new_tokens=40))
    assert [r.tokens for r in results] == [full[len(p):] for p, full in zip(prompts, expected)]
    got = keys(runtime.backend)
    assert got["target"] <= {(batch, t) for t in range(1, depth + 2)} and len(got["target"]) >= 3
    assert got["drafter"] == {(batch, depth + 1)}
    assert runtime.backend.cache_slots == {256}  # static: every drafter call read the whole static cache


def test_sampling_in_static_mode_draws_what_the_growing_caches_draw(target, drafter):
    """Same seed, same random draws: rejection sampling over the graphs' static outputs (the draft
    distributions are read after the target's replay) samples exactly what the default mode does."""
    config = GenerationConfig(max_new_tokens=16, temperature=0.8, seed=3)
    default = make_runtime(target, drafter, 3, verify_policy="fixed").generate(PROMPTS[:2], config)
    graphed = make_runtime(target, drafter, 3, verify_policy="fixed", cuda_graphs=True,
                           capture=replay_eagerly).generate(PROMPTS[:2], config)
    assert [r.tokens for r in graphed] == [r.tokens for r in default]
    assert sum(r.stats.new_tokens for r in graphed) == 32


def test_one_stream_at_a_time_per_batch_size_uses_the_static_caches(target, drafter):
    """Two streams of one batch size on one static-cache runtime would write the same caches: the
    second is refused while the first runs, and runs once the first is closed; another batch size, or
    growing caches, interleave freely and stay lossless."""
    config = GenerationConfig(max_new_tokens=12)
    runtime = make_runtime(target, drafter, 3, static_cache=True)
    first = runtime.stream(PROMPTS[:2], config)
    next(first)
    with pytest.raises(EagleExportError, match="a stream of batch 2 started while another of batch 2") as err:
        next(runtime.stream(PROMPTS[1:3], config))
    assert "close()" in err.value.fix
    other_size = runtime.generate(PROMPTS[:1], config)  # batch 1 has caches of its own
    assert other_size[0].tokens == target.generate_greedy(PROMPTS[0], 12)
    first.close()
    assert [r.tokens for r in runtime.generate(PROMPTS[1:3], config)] == [
        target.generate_greedy(p, 12) for p in PROMPTS[1:3]]
    growing = make_runtime(target, drafter, 3)
    a, b = growing.stream(PROMPTS[:2], config), growing.stream(PROMPTS[:2], config)
    tokens = {0: [], 1: []}
    for event_a, event_b in zip(a, b):
        assert event_a.index == event_b.index and event_a.tokens == event_b.tokens
        tokens[event_a.index] += event_a.tokens
    assert [tokens[0], tokens[1]] == [target.generate_greedy(p, 12) for p in PROMPTS[:2]]


# ------------------------------------------------------------ the real capture

@pytest.mark.cuda
def test_cuda_graphs_on_a_gpu_are_lossless(target, drafter):
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a CUDA GPU")
    gpu_target, gpu_drafter = target.to("cuda"), drafter.to("cuda")
    try:
        depth = 3
        backend = TorchBackend(TargetGraph(gpu_target, True), UnrolledDrafter(gpu_drafter, depth, False),
                               UnrolledDrafter(gpu_drafter, depth, True), device="cuda", cuda_graphs=True)
        runtime = SpeculativeRuntime.for_models(backend, gpu_target, gpu_drafter, max_context=128)
        for batch in (1, 2):
            results = runtime.generate(PROMPTS[:batch], GenerationConfig(max_new_tokens=24))
            assert [r.tokens for r in results] == [gpu_target.generate_greedy(p, 24) for p in PROMPTS[:batch]]
        assert keys(backend)["drafter"] == {(1, depth + 1), (2, depth + 1)}
        assert all(g.copied_bound == 0 for g in backend.captured.values())
    finally:
        target.to("cpu"), drafter.to("cpu")


@pytest.mark.parametrize("backend, problem", [("torch", "needs a CUDA GPU"), ("onnxruntime", "torch backend's fast path"),
                                              ("auto", "torch backend's fast path")])
def test_cuda_graphs_asked_for_where_they_cannot_run_are_refused_before_loading(monkeypatch, backend, problem):
    from types import SimpleNamespace as NS

    from eagle_export.builder import build_dir

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(build_dir, "torch_models", lambda *a, **k: pytest.fail("loaded the models first"))
    with pytest.raises(EagleExportError, match=problem):
        build_dir.make_backend(None, NS(engines=[], models={}), backend, cuda_graphs=True)
