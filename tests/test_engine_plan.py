"""The TensorRT decisions, computed without TensorRT: profiles, engine names, compatibility."""

import pytest
from tiny_models import tiny_drafter_config, tiny_target_config

from eagle_export.builder.recipe import parse_recipe
from eagle_export.engine.engine import (
    MIN_PAST,
    Engine,
    axis_ranges,
    engine_compatibility_problems,
    engine_file_name,
    engine_profiles,
    pick_engine,
)
from eagle_export.environment import buildable_precisions
from eagle_export.errors import EagleExportError
from eagle_export.models.config import DrafterConfig, TargetConfig
from eagle_export.models.contract import DRAFTER_NEW_ROWS, drafter_graph, target_graph
from eagle_export.speculation.tree import TreeShape

RECIPE = parse_recipe("target: t\ndrafter: d\ndepth: 4\nprofiles:\n  batch: {min: 1, opt: 2, max: 8}\n"
                      "  context: {min: 16, opt: 256, max: 1024}\n")
PROFILES, CHAIN = RECIPE["profiles"], RECIPE.speculation


@pytest.fixture
def specs():
    target_cfg = TargetConfig.from_hf(tiny_target_config("llama"))
    drafter_cfg = DrafterConfig.from_hf(tiny_drafter_config("3.1"))
    return target_graph(target_cfg, 3, return_logits=False), drafter_graph(drafter_cfg, CHAIN, sampling=False)


def test_target_profiles_cover_prefill_and_verify(specs):
    prefill, decode = engine_profiles(specs[0], CHAIN, PROFILES, "target")
    assert prefill["input_ids"] == ((1, 1), (2, 256), (8, 1024))
    assert decode["input_ids"] == ((1, 1), (2, 5), (8, 5))  # verify K+1 tokens
    assert decode["past_key"] == ((6, 1, 2, MIN_PAST, 16), (6, 2, 2, 256, 16), (6, 8, 2, 1024, 16))
    assert decode["cache_lens"] == ((1,), (2,), (8,))
    assert set(prefill) == {"input_ids", "positions", "past_key", "past_value", "cache_lens", "tree_mask"}
    assert prefill["tree_mask"] == ((1, 1, 1), (2, 256, 256), (8, 1024, 1024))
    assert decode["tree_mask"] == ((1, 1, 1), (2, 5, 5), (8, 5, 5))


def test_target_decode_profile_covers_a_trees_verify_width(specs):
    tree = TreeShape.from_branching([4, 1, 1, 1])  # 16 nodes, depth 4, 12 drafter step rows
    _, decode = engine_profiles(specs[0], tree, PROFILES, "target")
    assert decode["input_ids"] == ((1, 1), (2, 17), (8, 17)) and decode["tree_mask"][2] == (8, 17, 17)
    assert engine_profiles(specs[1], tree, PROFILES, "drafter")[1]["input_ids"][2] == (8, 5)  # an accepted path + 1
    # the drafter's new K/V rows: its input rows and every step row (a chain's K - 1 would be 3)
    assert axis_ranges(tree, PROFILES, "drafter", "decode")[DRAFTER_NEW_ROWS] == (13, 17, 17)


def test_every_dynamic_input_has_a_profile_with_ordered_bounds(specs):
    for spec, graph in zip(specs, ("target", "drafter")):
        for shapes in engine_profiles(spec, CHAIN, PROFILES, graph):
            assert set(shapes) == {t.name for t in spec.inputs if t.dynamic_axes}
            for lo, opt, hi in shapes.values():
                assert all(a <= b <= c for a, b, c in zip(lo, opt, hi))


def test_drafter_decode_profile_is_k_plus_one_rows(specs):
    _, decode = engine_profiles(specs[1], CHAIN, PROFILES, "drafter")
    assert decode["input_ids"][2] == (8, 5) and decode["aux_hidden"][2] == (8, 5, 192)


def test_engine_name_carries_gpu_and_tensorrt():
    assert engine_file_name("target", "9.0", "10.13.2.6") == "target.sm90.trt10.13.engine"


META = Engine("target", "target.sm90.trt10.13.engine", tensorrt="10.13.2", compute_capability="9.0", gpu="H100")


def test_compatible_engine_is_picked():
    assert pick_engine([META], "9.0", "10.13.3") is META


@pytest.mark.parametrize("cc,trt,problem", [
    ("8.9", "10.13.2", "built for compute capability 9.0 (H100), this GPU has 8.9"),
    ("9.0", "10.8.0", "built with TensorRT 10.13.2, this machine has 10.8.0"),
    (None, "10.13.2", "no CUDA GPU"),
    ("9.0", None, "TensorRT is not installed"),
])
def test_incompatible_engine_is_refused_with_the_reason(cc, trt, problem):
    assert problem in engine_compatibility_problems(META, cc, trt)
    with pytest.raises(EagleExportError, match="no engine in this build fits"):
        pick_engine([META], cc, trt)


def test_buildable_precisions_follow_compute_capability():
    assert buildable_precisions("9.0", True)["fp8"] == "yes"
    assert "10.0+" in buildable_precisions("9.0", True)["nvfp4"]
    assert "8.9+" in buildable_precisions("8.6", True)["fp8"]
    assert buildable_precisions("10.0", True)["nvfp4"] == "yes"
    assert "TensorRT is not installed" in buildable_precisions("9.0", False)["fp16"]


@pytest.mark.tensorrt
@pytest.mark.cuda
def test_tensorrt_builds_and_runs_a_strongly_typed_graph(tmp_path):
    """The thin API layer end to end on a tiny graph: parse, profile, build, bind by name, run."""
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (it needs NVIDIA's own index and a GPU)")
    import numpy as np
    import onnx
    import torch
    from onnx import TensorProto, helper

    from eagle_export.engine.engine import build_engine
    from eagle_export.engine.trt_session import TensorRTSession

    if not torch.cuda.is_available():
        pytest.skip("TensorRT engines need a CUDA GPU")
    weight = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="matmul")], "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor("w", TensorProto.FLOAT, weight.shape, weight.flatten())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.save(model, tmp_path / "tiny.onnx")
    build_engine(tmp_path / "tiny.onnx", tmp_path / "tiny.engine", [{"x": ((1, 8), (2, 8), (4, 8))}],
                 workspace_bytes=1 << 28, timing_cache_path=tmp_path / "timing.cache")
    assert (tmp_path / "timing.cache").stat().st_size > 0
    x = torch.randn(3, 8, device="cuda")
    y = TensorRTSession(tmp_path / "tiny.engine").run({"x": x})["y"]
    assert torch.allclose(y.cpu(), x.cpu() @ torch.from_numpy(weight), atol=1e-3)


def test_example_args_follow_the_spec_by_name():
    import torch

    from eagle_export.models import contract as C

    target_cfg = TargetConfig.from_hf(tiny_target_config("llama"))
    drafter_cfg = DrafterConfig.from_hf(tiny_drafter_config("3.1"))
    sizes = {C.BATCH: 3, C.TOKENS: 5, C.PAST: 6}
    for spec in (target_graph(target_cfg, 3, return_logits=True), drafter_graph(drafter_cfg, CHAIN, sampling=True)):
        zeros = spec.feeds(C.example_args(spec, sizes, dtype=torch.float16))
        random = spec.feeds(C.example_args(spec, sizes, torch.Generator().manual_seed(0), torch.float16))
        for t in spec.inputs:
            shape = tuple(sizes[d] if isinstance(d, str) else d for d in t.shape)
            dtype = {"int64": torch.int64, "float32": torch.float32, "bool": torch.bool,
                     C.MODEL_DTYPE: torch.float16}[t.dtype]
            for args in (zeros, random):
                assert args[t.name].shape == shape and args[t.name].dtype == dtype, t.name
        assert zeros[C.CACHE_LENS].tolist() == random[C.CACHE_LENS].tolist() == [6, 3, 6]  # ragged
        assert not zeros[C.PAST_KEY].any() and random[C.PAST_KEY].std() > 0.5
        assert 0 < random[C.INPUT_IDS].max() < spec.vocab_size == 320
    assert zeros[C.NUM_VALID].tolist() == [5, 1, 5] and zeros[C.UNIFORM_NOISE].eq(0.5).all()
    assert ((0.5 <= random[C.TEMPERATURE]) & (random[C.TEMPERATURE] < 1.5)).all()


@pytest.mark.parametrize("installed, conflict", [
    ({"onnxruntime": "1.22.0", "onnxruntime-gpu": "1.22.0"}, True),
    ({"onnxruntime-gpu": "1.22.0"}, False), ({"onnxruntime": "1.22.0"}, False)])
def test_doctor_names_onnxruntime_beside_onnxruntime_gpu_and_the_fix(monkeypatch, installed, conflict):
    import eagle_export.tools.doctor as doctor

    monkeypatch.setattr(doctor, "package_version", installed.get)
    found = doctor.package_conflicts()
    assert bool(found) == conflict
    if conflict:
        assert "onnxruntime 1.22.0 and onnxruntime-gpu 1.22.0" in found[0]
        assert found[0].endswith("Fix: pip uninstall -y onnxruntime onnxruntime-gpu && pip install onnxruntime-gpu")
        assert found[0] in doctor.doctor_report()["advice"]


@pytest.mark.parametrize("cc, precision, refused", [
    ("8.0", "fp8", "precision.target is fp8, which TensorRT cannot build on this A100: no (needs compute capability "
                   "8.9+, this GPU has 8.0)"),
    ("9.0", "nvfp4", "precision.target is nvfp4, which TensorRT cannot build on this A100: no (needs compute "
                     "capability 10.0+, this GPU has 9.0)"),
    ("9.0", "fp8", None), ("10.0", "nvfp4", None)])
def test_build_refuses_engine_precisions_the_gpu_lacks_before_loading(monkeypatch, tmp_path, cc, precision, refused):
    import eagle_export.builder.build as build

    recipe = parse_recipe(f"target: t\ndrafter: d\nprecision: {{target: {precision}}}\n")
    monkeypatch.setattr(build, "tensorrt_available", lambda: (True, ""))
    monkeypatch.setattr(build, "gpu_info", lambda: {"name": "A100", "compute_capability": cc, "memory_gib": 80})
    monkeypatch.setattr(build, "resolve_sources", lambda r: (_ for _ in ()).throw(RuntimeError("loading")))
    with pytest.raises(EagleExportError if refused else RuntimeError) as e:
        build.build(recipe, tmp_path / "out")
    assert (e.value.problem if refused else str(e.value)) == (refused or "loading")
    assert not (tmp_path / "out").exists()
    if refused:
        assert "--set precision.target=fp16" in e.value.fix


# ---------------------------------------------------------------- TensorRTSession on a fake TensorRT

DEPTH = 4


def fake_sessions(monkeypatch, tmp_path, specs, target_dtype="HALF", drafter_dtype="HALF", location=None):
    """Engine files for the tiny specs behind a fake `tensorrt` module; torch's current stream faked."""
    import sys
    import types

    import fake_tensorrt as fake
    import torch

    engines = {}
    for graph, spec, dtype in (("target", specs[0], target_dtype), ("drafter", specs[1], drafter_dtype)):
        engines[graph.encode()] = fake.FakeEngine(spec, engine_profiles(spec, CHAIN, PROFILES, graph), dtype, CHAIN,
                                                  location or fake.TensorLocation.HOST)
        (tmp_path / f"{graph}.engine").write_bytes(graph.encode())
    monkeypatch.setitem(sys.modules, "tensorrt", fake.module(engines))
    stream = types.SimpleNamespace(cuda_stream=0xC0FFEE)  # no synchronize(): the session must not wait
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    return engines


def target_feeds(tokens, past, batch=2, dtype=None):
    import torch

    from eagle_export.models import contract as C

    dtype = dtype or torch.float16
    cache = torch.zeros(6, batch, 2, past, 16, dtype=dtype)
    return {C.INPUT_IDS: torch.ones(batch, tokens, dtype=torch.int64), C.POSITIONS: torch.zeros(batch, tokens,
            dtype=torch.int64), C.PAST_KEY: cache, C.PAST_VALUE: cache.clone(),
            C.CACHE_LENS: torch.zeros(batch, dtype=torch.int64),
            C.TREE_MASK: torch.ones(batch, tokens, tokens, dtype=torch.bool).tril()}


def test_session_binds_by_name_and_enqueues_on_torchs_current_stream(monkeypatch, tmp_path, specs):
    """The runtime writes the caches on torch's current stream: the engine must run on it (before:
    on a stream of its own, unordered with those writes), and switch profiles there too."""
    from eagle_export.engine.trt_session import TensorRTSession

    engine = fake_sessions(monkeypatch, tmp_path, specs)[b"target"]
    session = TensorRTSession(tmp_path / "target.engine")
    context = engine.contexts[0]
    for tokens, profile in ((7, 0), (5, 1), (9, 0)):  # prefill -> decode -> prefill on one context
        feeds = target_feeds(tokens, past=64)
        out = session.run(feeds, profile)
        assert context.profile == profile
        assert out["greedy_ids"].shape == (2, tokens) and out["new_key"].dtype.itemsize == 2
        assert out["aux_hidden"].shape == (2, tokens, specs[0]["aux_hidden"].shape[2])
        assert all(context.addresses[n] == t.data_ptr() for n, t in {**feeds, **out}.items())
    streams = {c[-1] for c in context.calls if c[0] in ("set_optimization_profile_async", "execute_async_v3")}
    assert streams == {0xC0FFEE}
    assert [c[1] for c in context.calls if c[0] == "set_optimization_profile_async"] == [0, 1, 0]


def test_out_of_profile_shapes_name_the_tensor_and_the_profile_range(monkeypatch, tmp_path, specs):
    from eagle_export.engine.trt_session import TensorRTSession

    fake_sessions(monkeypatch, tmp_path, specs)
    session = TensorRTSession(tmp_path / "target.engine")
    with pytest.raises(EagleExportError) as e:
        session.run(target_feeds(5, past=1025), profile=1)  # context.max is 1024
    assert e.value.problem == ("target.engine: input past_key has shape (6, 2, 2, 1025, 16), outside optimization "
                               "profile 1 (min (6, 1, 2, 1, 16), max (6, 8, 2, 1024, 16))")
    assert "profiles.context.max" in e.value.fix
    with pytest.raises(EagleExportError, match=r"input input_ids has shape \(9, 5\), outside optimization profile 1 "
                                               r"\(min \(1, 1\), max \(8, 5\)\)"):
        session.run(target_feeds(5, past=8, batch=9), profile=1)


def test_bound_tensors_must_have_the_engines_dtype_and_device(monkeypatch, tmp_path, specs):
    import fake_tensorrt as fake
    import torch

    from eagle_export.engine.trt_session import TensorRTSession

    fake_sessions(monkeypatch, tmp_path, specs)
    with pytest.raises(EagleExportError) as e:
        TensorRTSession(tmp_path / "target.engine").run(target_feeds(5, 8, dtype=torch.float32), 1)
    assert e.value.problem == "target.engine: input past_key is torch.float32 on cpu, the engine takes torch.float16 on cpu"
    fake_sessions(monkeypatch, tmp_path, specs, location=fake.TensorLocation.DEVICE)
    with pytest.raises(EagleExportError, match="input input_ids is torch.int64 on cpu, the engine takes torch.int64 "
                                               "on cuda"):
        TensorRTSession(tmp_path / "target.engine").run(target_feeds(5, 8), 1)


def test_a_refused_address_or_missing_input_is_an_error_not_a_silent_run(monkeypatch, tmp_path, specs):
    from eagle_export.engine.trt_session import TensorRTSession

    engine = fake_sessions(monkeypatch, tmp_path, specs)[b"target"]
    session = TensorRTSession(tmp_path / "target.engine")
    engine.contexts[0].refuse_address.add("new_key")
    with pytest.raises(EagleExportError, match=r"TensorRT refused the address of target.engine's new_key \(\(6, 2, 2, "
                                               r"5, 16\) torch.float16 on cpu\)"):
        session.run(target_feeds(5, 8), 1)
    assert not any(c[0] == "execute_async_v3" for c in engine.contexts[0].calls)
    feeds = target_feeds(5, 8)
    del feeds["cache_lens"]
    with pytest.raises(EagleExportError, match="takes an input 'cache_lens' that was not given"):
        session.run(feeds, 1)
    with pytest.raises(EagleExportError, match="TensorRT cannot load other.engine"):
        (tmp_path / "other.engine").write_bytes(b"patched TensorRT")
        TensorRTSession(tmp_path / "other.engine")


def test_tensorrt_backend_allocates_each_cache_in_its_engines_dtype(monkeypatch, tmp_path, specs):
    """A fp16 target engine beside an fp32 drafter engine: the drafter's caches are fp32 (before:
    the target's dtype, which the drafter engine would have read as garbage)."""
    import torch

    from eagle_export.runtime.backends import TensorRTBackend
    from eagle_export.runtime.runtime import GenerationConfig, PairShapes, SpeculativeRuntime, _State

    fake_sessions(monkeypatch, tmp_path, specs, target_dtype="HALF", drafter_dtype="FLOAT")
    backend = TensorRTBackend(tmp_path / "target.engine", tmp_path / "drafter.engine", DEPTH, has_logits=False)
    assert (backend.model_dtype, backend.drafter_dtype) == (torch.float16, torch.float32)
    monkeypatch.setattr(TensorRTBackend, "device", "cpu")
    runtime = SpeculativeRuntime(backend, PairShapes(6, 2, 16, 2, 16, 192, max_context=64))
    state = _State(runtime, [[1, 2, 3]], GenerationConfig(max_new_tokens=4))
    assert state.target_k.dtype == state.target_v.dtype == torch.float16
    assert state.draft_k.dtype == state.draft_v.dtype == torch.float32
