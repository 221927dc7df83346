"""`eagle-export selftest --gpu`: everything only a GPU can settle, in order, each step one assertion
or one printed fact, written to one JSON report. The first command a user with a GPU runs.

A step is a function of the shared state returning (ok, fact): ok True (held), False (failed) or
None (a fact, or a check this machine or build cannot make, the reason in the fact). A step that
raises fails with the error as its fact, and the later steps still run. Without TensorRT engines
(TensorRT not installed) the steps that need none still run: the torch backend's CUDA graphs, the bench.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import onnx
import onnxruntime
import torch
import yaml

from ..builder.build import build as run_build
from ..builder.build import check_engine_precisions
from ..builder.build_dir import open_build
from ..builder.manifest import MANIFEST, check_build
from ..builder.recipe import load_recipe, parse_recipe
from ..builder.validate import TOLERANCE
from ..data.prompts import chat_prompts
from ..engine.engine import axis_ranges, profile_shapes
from ..environment import cuda_available, gpu_info, package_version, tensorrt_version
from ..errors import EagleExportError
from ..models import contract as C
from ..models.checkpoint import resolve_dtype
from ..output_dir import write_output
from ..runtime.backends import OnnxRuntimeBackend, ort_session, run_onnx
from ..runtime.runtime import GenerationConfig
from ..speculation.tree import random_verify_mask
from .bench import bench
from .doctor import NO_GPU_SELFTEST, package_conflicts

LOOPS = 50              # lossless repetitions on TensorRT: a stream race shows up as a rare mismatch
BENCH_BATCHES = (1, 4)
_ELEMENT = {onnx.TensorProto.INT64: "int64", onnx.TensorProto.BOOL: "bool", onnx.TensorProto.FLOAT: C.MODEL_DTYPE,
            onnx.TensorProto.FLOAT16: C.MODEL_DTYPE, onnx.TensorProto.BFLOAT16: C.MODEL_DTYPE}


def environment(state) -> tuple:
    trt_wheel = next((w for w in ("tensorrt-cu12", "tensorrt-cu13", "tensorrt") if package_version(w)), None)
    ort_builds = {w: package_version(w) for w in ("onnxruntime", "onnxruntime-gpu") if package_version(w)}
    torch_major = (torch.version.cuda or "").split(".")[0]
    problems = package_conflicts()
    if trt_wheel and trt_wheel[-2:].isdigit() and trt_wheel[-2:] != torch_major:
        problems.append(f"{trt_wheel} beside a CUDA {torch_major} torch: pip install tensorrt-cu{torch_major}")
    fact = (f"torch {torch.__version__} (CUDA {torch.version.cuda}); TensorRT {tensorrt_version()} ({trt_wheel}); "
            f"onnxruntime {ort_builds}, device {onnxruntime.get_device()}, providers "
            f"{onnxruntime.get_available_providers()}; GPU {gpu_info()}")
    return not problems, fact + "".join(f"; PROBLEM: {p}" for p in problems)


def build(state) -> tuple:
    """The build to test (--build), or the sample built here: both graphs parsed and built with both profiles."""
    if state["build_dir"] is None:
        state["build_dir"] = state["scratch"] / "sample"
        run_build(load_recipe(None), state["build_dir"], echo=lambda line: None)
    state["opened"] = opened = open_build(state["build_dir"], backend="tensorrt", verify_policy="fixed")
    engines = {e.graph: e.file for e in opened.manifest.engines}
    return set(engines) == {"target", "drafter"}, f"{state['build_dir']}: engines {engines}"


def _graph_spec(path: Path, vocab_size: int) -> C.GraphSpec:
    """The graph's inputs as the ONNX file declares them (names, dims, contract axes)."""
    model = onnx.load(str(path), load_external_data=False)
    inputs = tuple(C.TensorSpec(i.name, tuple(d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim),
                                _ELEMENT.get(i.type.tensor_type.elem_type, "float32")) for i in model.graph.input)
    return C.GraphSpec(inputs, (), vocab_size)


def _sessions(state):
    backend = state["opened"].runtime.backend
    manifest = state["opened"].manifest
    files = {"target": manifest.target_graph.file, "drafter": manifest.drafter_graph.file}
    return {g: (s, state["build_dir"] / files[g], _graph_spec(state["build_dir"] / files[g], manifest.target.vocab_size))
            for g, s in (("target", backend.target_session), ("drafter", backend.drafter_session))}


def engine_io(state) -> tuple:
    """Engine I/O dtypes and profile shapes equal what the project computed from the recipe."""
    manifest, wrong = state["opened"].manifest, []
    for graph, (session, _, spec) in _sessions(state).items():
        for profile, phase in enumerate(("prefill", "decode")):
            for name, shapes in profile_shapes(spec, axis_ranges(manifest.speculation, manifest.profiles, graph, phase)).items():
                got = tuple(tuple(d) for d in session.engine.get_tensor_profile_shape(name, profile))
                wrong += [f"{graph}/{phase} {name}: {got} != {shapes}"] if got != shapes else []
        model_dtype = resolve_dtype(getattr(state["opened"].manifest, graph).dtype)  # what the build exported
        for t in spec.inputs:
            want = {"int64": torch.int64, "bool": torch.bool}.get(t.dtype, model_dtype)
            wrong += [f"{graph} {t.name}: {session.dtypes[t.name]} != {want}"] if session.dtypes[t.name] != want else []
    return not wrong, "; ".join(wrong) or "every profile shape and input dtype as computed"


def _feeds(spec, dtype, tokens, past, batch=2, tree=False):
    sizes = {C.BATCH: batch, C.TOKENS: tokens, C.PAST: past}
    generator = torch.Generator().manual_seed(tokens)
    args = C.example_args(spec, sizes, generator, dtype, random_verify_mask(batch, tokens, generator) if tree else None)
    return {name: a.cuda() for name, a in spec.feeds(args).items()}


def against_onnxruntime(state) -> tuple:
    """prefill -> decode -> prefill on one context, each against ONNX Runtime CPU on the same inputs."""
    dtype = state["opened"].manifest.target.dtype
    depth, facts, ok = state["opened"].manifest.depth, [], True
    for graph, (session, path, spec) in _sessions(state).items():
        cpu = ort_session(path)
        model_dtype = session.dtypes[C.PAST_KEY]
        # prefill, decode, prefill again, then (the target) a token tree's verify call on the decode profile
        runs = [(0, 7, 16, False), (1, depth + 1, 32, False), (0, 7, 16, False)]
        runs += [(1, depth + 1, 32, True)] if graph == "target" else []
        results = []
        for profile, tokens, past, tree in runs:
            feeds = _feeds(spec, model_dtype, tokens, past, tree=tree)
            got = {k: v.cpu() for k, v in session.run(dict(feeds), profile).items()}
            torch.cuda.synchronize()
            want = run_onnx(cpu, {k: v.cpu() for k, v in feeds.items()})
            ids = C.GREEDY_IDS if graph == "target" else C.DRAFT_IDS
            agree = (got[ids] == want[ids]).float().mean().item()
            value = C.AUX_HIDDEN if graph == "target" else C.DRAFT_TOKEN_PROBS
            err = ((got[value].float() - want[value].float()).abs().max() / want[value].float().abs().max()).item()
            ok &= agree >= (1.0 if dtype == "fp32" else 0.995) and err <= max(TOLERANCE[dtype], 1e-4)
            results.append(got)
            facts.append(f"{graph} profile {profile} T={tokens}{' tree' if tree else ''}: ids {agree:.3f}, "
                         f"{value} rel. err {err:.1e}")
        ok &= torch.equal(results[0][ids], results[2][ids])  # the third call (prefill again) repeats the first
    return ok, "; ".join(facts) + f" (tolerance {TOLERANCE[dtype]:g})"


def lossless_loop(state) -> tuple:
    """The lossless loop on TensorRT, repeated: speculative == autoregressive every time."""
    opened = state["opened"]
    prompts = [opened.encode(p) for p in ("Explain what a speculative decoder does.", "List three prime numbers.")]
    config = GenerationConfig(max_new_tokens=32)
    expected = [r.tokens for r in opened.runtime.generate(prompts, config, speculative=False)]
    bad = sum([r.tokens for r in opened.runtime.generate(prompts, config)] != expected for _ in range(LOOPS))
    return bad == 0, f"{bad} of {LOOPS} speculative runs (batch 2 x 32 tokens) differ from autoregressive"


def out_of_profile(state) -> tuple:
    session, _, spec = _sessions(state)["target"]
    too_long = state["opened"].manifest.max_context + 1
    try:
        session.run(_feeds(spec, session.dtypes[C.PAST_KEY], 1, too_long), 1)
    except EagleExportError as e:
        return "outside optimization profile" in e.problem, e.problem
    return False, f"a past of {too_long} slots ran without an error"


def fp8_tactics(state) -> tuple:
    """FP8 engines on Hopper and later: does the engine inspector show FP8 layers?"""
    import tensorrt as trt  # optional (absent on machines without a GPU): only this step needs its module

    if "fp8" not in {m.precision for m in state["opened"].manifest.models.values()}:
        return None, "not an FP8 build: rerun with --build of `eagle-export build --set precision.target=fp8`"
    session = _sessions(state)["target"][0]
    info = session.engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON)
    layers = json.loads(info).get("Layers", [])
    fp8 = [layer for layer in layers if "fp8" in json.dumps(layer).lower()]
    return bool(fp8), f"{len(fp8)} of {len(layers)} target engine layers mention FP8"


def nvfp4_refused(state) -> tuple:
    gpu = gpu_info()
    if tuple(int(x) for x in gpu["compute_capability"].split(".")) >= (10, 0):
        return None, f"this GPU builds NVFP4 (compute capability {gpu['compute_capability']})"
    try:
        check_engine_precisions({"target": "nvfp4", "drafter": "nvfp4"}, gpu)
    except EagleExportError as e:
        return True, e.problem
    return False, "an NVFP4 build was not refused"


def onnxruntime_cuda(state) -> tuple:
    """ONNX Runtime's CUDA provider running the build's graphs (FP8 ones where the build is FP8)."""
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return None, "ONNX Runtime has no CUDA provider here (pip install onnxruntime-gpu, see doctor)"
    manifest, path = state["opened"].manifest, state["build_dir"]
    fp8 = "fp8" in {m.precision for m in manifest.models.values()}
    backend = OnnxRuntimeBackend(path / manifest.target_graph.file, path / manifest.drafter_graph.file)
    spec = _sessions(state)["target"][2]
    out = backend.target(_feeds(spec, backend.model_dtype, 5, 16))
    return backend.device == "cuda" and out[C.NEW_KEY].is_cuda, \
        f"{'FP8 ' if fp8 else ''}graphs on {backend.providers}, outputs on {out[C.NEW_KEY].device}"


def torch_cuda_graphs(state) -> tuple:
    """The torch backend with static caches and CUDA graphs: speculative == autoregressive (both
    replayed from graphs) at batch 1 and 4, and agreement with eager torch's autoregressive output."""
    graphed = open_build(state["build_dir"], backend="torch", verify=False, cuda_graphs=True, verify_policy="fixed")
    eager = open_build(state["build_dir"], backend="torch", verify=False, cuda_graphs=False)
    prompts = list(chat_prompts(graphed.chat_template(), "mt-bench", 4))
    config = GenerationConfig(max_new_tokens=48, eos_ids=graphed.eos_ids)
    differ, eager_differ = 0, 0
    for batch in (1, 4):
        for chunk in (prompts[i:i + batch] for i in range(0, len(prompts), batch)):
            spec = [r.tokens for r in graphed.runtime.generate(chunk, config)]
            plain = [r.tokens for r in graphed.runtime.generate(chunk, config, speculative=False)]
            reference = [r.tokens for r in eager.runtime.generate(chunk, config, speculative=False)]
            differ += sum(a != b for a, b in zip(spec, plain))
            eager_differ += sum(a != b for a, b in zip(plain, reference))
    names = {None: "target", False: "drafter", True: "sampling drafter"}
    captured = {names[k]: sorted(g.keys()) for k, g in graphed.runtime.backend.captured.items() if g.graphs}
    return differ == 0, (f"{differ} of 8 speculative sequences (batch 1 and 4) differ from autoregressive on "
                         f"CUDA graphs; {eager_differ} of 8 autoregressive ones differ from eager torch's; "
                         f"graphs captured (batch, width): {captured}")


BENCH_RUNS = (("tensorrt", "tensorrt", None), ("onnxruntime", "onnxruntime", None), ("torch", "torch", False),
              ("torch+cuda-graphs", "torch", True))


def bench_backends(state) -> tuple:
    figures = {}
    for label, backend, cuda_graphs in BENCH_RUNS:
        try:
            opened = open_build(state["build_dir"], backend=backend, verify=False, cuda_graphs=cuda_graphs)
        except EagleExportError as e:
            figures[label] = f"not run: {e.problem}"
            continue
        prompts = list(chat_prompts(opened.chat_template(), "mt-bench", 8))
        config = GenerationConfig(max_new_tokens=64, eos_ids=opened.eos_ids)
        for batch in BENCH_BATCHES:
            result = bench({label: opened.runtime}, prompts, batch, config)
            figures[f"{label} batch {batch}"] = {
                "ar_tokens_per_s": round(result["ar_tokens_per_s"], 1),
                **{name: {"tokens_per_s": round(p["spec_tokens_per_s"], 1), "speedup": round(p["speedup"], 3)}
                   for name, p in result["builds"][label]["policies"].items()}}
    state["bench"] = figures
    return None, json.dumps(figures)


# The best tree of at most 16 nodes on the sample pair, offline (tau 1.65 against the chain's 1.32 on MT-bench).
TREE = {"kind": "dynamic_tree", "top_k": 8, "depth": 3, "nodes": 16}


def tree_vs_chain(state) -> tuple:
    """The build beside its twin drafting a dynamic tree (same recipe and sources, greedy), built here
    and benched side by side on the backend `open_build` picks (TensorRT when the builds have engines):
    tau, verify width and speedup per build and batch; every output must equal plain decoding. Where a
    wide verify call costs about what a narrow one does, the tree's higher tau is speed."""
    manifest = check_build(state["build_dir"])
    recipe = {k: v for k, v in manifest.recipe.items() if k not in ("depth", "speculation") and v is not None}
    recipe.update(target=manifest.target.source, drafter=manifest.drafter.source)
    tree_dir = state["scratch"] / "tree"
    run_build(parse_recipe(yaml.safe_dump(recipe), "selftest tree twin", overrides={"speculation": TREE, "sampling": False}),
              tree_dir, echo=lambda line: None)
    opened = {name: open_build(path, verify=False) for name, path in (("chain", state["build_dir"]), ("tree", tree_dir))}
    prompts = list(chat_prompts(opened["chain"].chat_template(), "mt-bench", 8))
    config = GenerationConfig(max_new_tokens=64, eos_ids=opened["chain"].eos_ids)
    figures, same = {}, True
    for batch in BENCH_BATCHES:
        result = bench({name: o.runtime for name, o in opened.items()}, prompts, batch, config)
        for name, build in result["builds"].items():
            for policy, p in build["policies"].items():
                same &= p["identical_to_autoregressive"]
                figures[f"{result['backend']} batch {batch} {name} {policy}"] = {
                    "tau": p["tau"], "verify_width": p["verify_width_mean"], "speedup": p["speedup"]}
    state["tree_vs_chain"] = figures
    return same, json.dumps(figures)


STEPS = [("environment", environment), ("build", build), ("engine I/O", engine_io),
         ("TensorRT vs ONNX Runtime CPU", against_onnxruntime), ("lossless loop x50", lossless_loop),
         ("out-of-profile input", out_of_profile), ("FP8 tactics", fp8_tactics), ("NVFP4 gating", nvfp4_refused),
         ("ONNX Runtime CUDA", onnxruntime_cuda), ("torch CUDA graphs lossless", torch_cuda_graphs),
         ("bench", bench_backends), ("tree vs chain", tree_vs_chain)]
# What still runs when the build has no TensorRT engines (TensorRT missing): the torch fast path and the benches.
WITHOUT_ENGINES = ("environment", "NVFP4 gating", "torch CUDA graphs lossless", "bench", "tree vs chain")


def selftest(build_dir, report_path, echo=print) -> dict | None:
    """Run every step; None (after one line) where there is no GPU."""
    if not cuda_available():
        echo(NO_GPU_SELFTEST)
        return None
    # The builds selftest makes (the sample, the tree twin) live in a scratch folder removed at the end.
    with tempfile.TemporaryDirectory(prefix="eagle-export-selftest-") as scratch:
        state = {"build_dir": Path(build_dir) if build_dir else None, "scratch": Path(scratch)}
        steps, engines = [], True
        for name, step in STEPS:
            if not engines and name not in WITHOUT_ENGINES:
                ok, fact = None, "skipped: the build has no TensorRT engines"
            else:
                try:
                    ok, fact = step(state)
                except Exception as e:  # a failed step is a finding: the report goes on
                    ok, fact = False, f"{type(e).__name__}: {getattr(e, 'problem', None) or e}"
            steps.append({"step": name, "ok": ok, "fact": fact})
            echo(f"{'ok  ' if ok else 'FAIL' if ok is False else '-   '} {name}: {fact}")
            if name == "build" and ok is not True:
                if not (state["build_dir"] and (state["build_dir"] / MANIFEST).is_file()):
                    break  # no build at all: nothing after it can run
                engines = False  # built without engines: the steps that need none still run
    report = {"ok": all(s["ok"] is not False for s in steps), "steps": steps, "bench": state.get("bench"),
              "tree_vs_chain": state.get("tree_vs_chain")}
    write_output(report_path, json.dumps(report, indent=2) + "\n")
    echo(f"report: {report_path}")
    return report
