"""`eagle-export build`: checkpoints + recipe -> a build directory a runtime can load, with proof.

load -> model passes -> quantize -> export (ONNX passes + lint inside) -> engines -> validate -> manifest
Everything is written into a temporary directory beside the output and renamed at the end
(output_dir.atomic_output_dir), so a failure, Ctrl-C or SIGTERM never leaves a half build, and --force
replaces only an earlier build, never a checkpoint the build reads.
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..data.prompts import ChatTemplate, chat_prompts
from ..engine.engine import Engine, build_engine, engine_file_name, engine_profiles
from ..environment import buildable_precisions, gpu_info, tensorrt_version
from ..errors import EagleExportError
from ..export.export import check_export_fits, export_pair, resolve_export_dtype
from ..export.heap import keep_large_blocks_in_heap, release_freed_memory, return_large_blocks_at_once
from ..export.loader import load_pair, passes_skipping, prepare_pair
from ..models import contract as C
from ..output_dir import atomic_output_dir
from ..passes.model_pipeline import model_passes
from ..passes.onnx_cleanup import onnx_pipeline
from ..quantize.quantize import quantize_pair
from . import conformance
from .build_dir import open_build
from .conformance import conformance_check
from .manifest import BUILD_OUTPUT, BuiltModel, GraphFile, Manifest, source_hashes, write_manifest
from .recipe import QUANTIZED, Recipe, resolve_sources
from .teacher_forced import measure_delta
from .validate import lossless_backend, validate_build_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


class StageLog:
    """One line when a stage starts and one with its elapsed time when it ends."""

    def __init__(self, echo, total: int):
        self.echo, self.total, self.index, self.seconds = echo, total, 0, {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        self.index += 1
        self.echo(f"[{self.index}/{self.total}] {name} ...")
        start = time.perf_counter()
        yield
        self.seconds[name] = round(time.perf_counter() - start, 2)
        self.echo(f"[{self.index}/{self.total}] {name} done in {self.seconds[name]:.1f} s")


def base_dtype(precision: str, tensorrt_present: bool) -> str:
    """Quantized models keep a float base: fp16 for TensorRT; fp32 where the graph runs on ONNX Runtime CPU."""
    if precision not in QUANTIZED:
        return precision
    return "fp16" if tensorrt_present else "fp32"


def calibration_prompts(recipe: Recipe, template: ChatTemplate) -> list[list[int]]:
    cal = recipe["calibration"]
    return list(chat_prompts(template, cal["dataset"], cal["num_samples"], cal["max_tokens"]))


def evaluation_prompts(recipe: Recipe, template: ChatTemplate, calibration: list[list[int]]) -> list[list[int]]:
    """Evaluation prompts the calibration never saw (metrics on calibration data flatter the quantizer)."""
    ev, cal = recipe["evaluation"], recipe["calibration"]
    seen = {tuple(p) for p in calibration}
    # Prompts keep their whole length here: a continuation must start where a real prompt ends.
    candidates = chat_prompts(template, ev["dataset"])
    held_out = list(itertools.islice((p for p in candidates if tuple(p[:cal["max_tokens"]]) not in seen),
                                     ev["num_prompts"]))
    if not held_out:
        raise EagleExportError(
            f"calibration uses every {ev['dataset']} prompt, leaving none to evaluate the quantized models on",
            "lower calibration.num_samples or set evaluation.dataset to another prompt set")
    return held_out


CONFORMANCE_PROMPTS = 8


def conformance_prompts(recipe: Recipe, target_dir: Path) -> list[list[int]]:
    """The prompts the build checks the drafter's conventions on: the first of the evaluation set."""
    return list(chat_prompts(ChatTemplate(target_dir), recipe["evaluation"]["dataset"], CONFORMANCE_PROMPTS,
                             recipe["calibration"]["max_tokens"]))


def conformance_stage(recipe: Recipe, target_dir: Path, drafter_dir: Path, source_files: dict, target, drafter,
                      echo, skip_gate: bool = False) -> dict:
    """`inspect --check` on the recipe's pair, run on the build's own loaded models (before the model
    passes; no second copy of either is loaded): refuse a drafter that matches no convention (with
    `skip_gate`, from --skip-conformance: say so and go on, for a pipeline smoke test with an
    untrained drafter; the record says the gate was skipped); report a field an alternative reading
    names, and go on (the config is the user's). A pair that passed is remembered by its files'
    hashes and the prompts: a rebuild reuses the result."""
    prompts = conformance_prompts(recipe, target_dir)
    cached = conformance.cache_file(source_files, prompts)
    result = conformance.read_cached(cached)
    if result is not None:
        echo(f"  same checkpoint files and prompts as an earlier build: its result reused ({cached})")
    else:
        result = conformance_check(target, drafter, prompts, 0, target.config.eos_ids)
        if result["matched"]:
            conformance.write_cached(cached, result)
    configured = result["readings"][0]["acc@1"]
    if skip_gate:
        result = {**result, "gate_skipped": "--skip-conformance"}
        if not result["matched"]:
            echo(f"  warning: the drafter matches no convention (acc@1 {configured[0]:.3f} as configured, below "
                 f"{result['min_acc']} under every reading): built anyway (--skip-conformance), so its drafts "
                 "will be rejected; fine for a pipeline smoke test, not for speed")
    elif not result["matched"]:
        raise EagleExportError(
            f"the drafter {drafter_dir} matches no convention: its teacher-forced acc@1 on {result['positions']} "
            f"positions is below {result['min_acc']} under its config ({configured[0]:.3f}) and under every "
            "alternative reading (aux numbering, norms, feedback, vocabulary map)",
            "check that the drafter was trained for this target and that config.json is its own "
            "(`eagle-export inspect DRAFTER --target TARGET --check` lists every reading); for a pipeline "
            "smoke test with an untrained drafter, build with --skip-conformance")
    for finding in result["findings"]:
        echo(f"  warning: {finding['message']}")
    echo(f"  drafter conventions: acc@1 {configured[0]:.3f} / {configured[1]:.3f} at steps 0 / 1 as configured"
         + ("" if result["ok"] or not result["findings"] else f"; {len(result['findings'])} field(s) named above")
         + conformance.gate_line(result))
    return result


def quantize_stage(recipe: Recipe, target, drafter, target_dir: Path) -> tuple:
    """Quantize the models the recipe asks for (`quantize_pair`) on the recipe's calibration set and
    measure them on held-out prompts. Returns (target, drafter, report): quantized copies where the
    recipe quantizes a model, the model given where it does not."""
    precision, ev = recipe["precision"], recipe["evaluation"]
    template = ChatTemplate(target_dir)
    prompts = calibration_prompts(recipe, template)
    if not prompts:
        raise EagleExportError("the calibration set gave no prompts", "raise calibration.num_samples")
    evaluation = evaluation_prompts(recipe, template, prompts)
    qtarget, qdrafter, measured = quantize_pair(
        target, drafter, *(precision[role] if precision[role] in QUANTIZED else None for role in ("target", "drafter")),
        prompts, evaluation, evaluation, evaluation if ev["tau"] else [], tuple(precision["keep_high_precision"]),
        recipe["depth"], ev["max_new_tokens"])
    report = {"calibration": {**recipe["calibration"], "prompts_used": len(prompts)},
              "evaluation": {**ev, "prompts_used": len(evaluation), "prompt_ids": evaluation}}
    return qtarget, qdrafter, {**report, **measured}


def export_stage(recipe: Recipe, build_dir: Path, pair: list, echo=print) -> dict[str, GraphFile]:
    """target.onnx, drafter.onnx (and drafter_sampling.onnx), quantized models through the Q/DQ rewrites.
    `pair` = [target, drafter], the build's only references to them: `export_pair` frees the target once
    its graph is written, and this stage the drafter once its graphs are (validation loads the
    unquantized pair again from the sources)."""
    precision, sampling = recipe["precision"], recipe["sampling"]
    quantized = tuple(precision[role] in QUANTIZED for role in ("target", "drafter"))
    # A quantized target also returns its logits: its lossless check reads each call's margins.
    logits = sampling or quantized[0]
    reports = export_pair(pair, build_dir, recipe.speculation, sampling, logits, quantized,
                          progress=lambda line: echo(f"  {line}"))
    return {key: GraphFile(f"{key}.onnx", return_logits=logits if key == "target" else False,
                           sampling=key == "drafter_sampling", report=report) for key, report in reports.items()}


def delta_stage(recipe: Recipe, build_dir: Path, target_dir: Path) -> dict:
    """A quantized target's width noise (`teacher_forced.measure_delta`), measured on the built graph
    through the backend its lossless checks run on, at call widths 1 and the verify width over the
    calibration prompts."""
    opened = open_build(build_dir, backend=lossless_backend(recipe["precision"].values()), verify=False,
                        verify_policy="fixed")
    t, backend = opened.manifest.target, opened.runtime.backend
    return measure_delta(backend, (t.num_layers, t.num_kv_heads, t.head_dim),
                         calibration_prompts(recipe, ChatTemplate(target_dir)), backend.verify_width)


def tensorrt_available() -> tuple[bool, str]:
    if tensorrt_version() is None:
        return False, "TensorRT is not installed"
    if gpu_info() is None:
        return False, "no CUDA GPU"
    return True, ""


def check_engine_precisions(precision: dict, gpu: dict) -> None:
    """Engines need the GPU's hardware for their precision (FP8 8.9+, NVFP4 10.0+): refuse before
    loading anything. Builds without engines are not gated: ONNX Runtime runs FP8 Q/DQ on CPU."""
    verdicts = buildable_precisions(gpu["compute_capability"], True)
    for role in ("target", "drafter"):
        verdict = verdicts[precision[role]]
        if verdict != "yes":
            raise EagleExportError(f"precision.{role} is {precision[role]}, which TensorRT cannot build on this "
                                   f"{gpu['name']}: {verdict}",
                                   f"set a precision this GPU supports (--set precision.{role}=fp16), "
                                   "or build on a newer GPU")


def build(recipe: Recipe, out_dir, force: bool = False, echo=print, skip_conformance: bool = False) -> dict:
    has_trt, no_trt_reason = tensorrt_available()
    if has_trt:
        check_engine_precisions(recipe["precision"], gpu_info())
    log = StageLog(echo, total=8)
    precision = recipe["precision"]
    sampling = recipe["sampling"]
    model_precisions = {precision["target"], precision["drafter"]}
    target_dir, drafter_dir = resolve_sources(recipe)
    with atomic_output_dir(out_dir, BUILD_OUTPUT, force, inputs=(target_dir, drafter_dir), warn=echo) as tmp:
        with log("load checkpoints"):
            # hashed before loading: a file changed meanwhile fails the check later, never passes it
            source_files = {"target": source_hashes(target_dir), "drafter": source_hashes(drafter_dir)}
            target_dtype = base_dtype(precision["target"], has_trt)
            drafter_dtype = base_dtype(precision["drafter"], has_trt)
            # before loading: the export stage's peak, as `export`'s (the same stage order)
            check_export_fits(target_dir, drafter_dir, resolve_export_dtype(target_dtype))
            # the model passes run after the conformance check, which reads the models as loaded
            target, drafter = load_pair(target_dir, drafter_dir, target_dtype, passes=(), drafter_dtype=drafter_dtype)
            return_large_blocks_at_once()  # while the build holds these models (to the end of the export stage)
            if ChatTemplate(target_dir).note:  # every prompt set of the build is read as raw text
                echo(f"  note: {ChatTemplate(target_dir).note}")
            positions = target.config.max_position_embeddings
            if recipe["profiles"]["context"]["max"] > positions:  # an opened build refuses it too
                raise EagleExportError(f"profiles.context.max {recipe['profiles']['context']['max']} exceeds the "
                                       f"target's {positions} positions (max_position_embeddings)",
                                       "lower profiles.context.max to the target's position count or less "
                                       "(--set profiles.context.max=N)")

        with log("check the drafter's conventions"):
            conformance_record = conformance_stage(recipe, target_dir, drafter_dir, source_files, target, drafter, echo,
                                                   skip_conformance)

        with log("model passes"):
            skip = set(recipe["passes"]["skip"])
            known = {p.name for p in model_passes()}
            unknown = skip - known - _onnx_pass_names()
            if unknown:
                raise EagleExportError(f"passes.skip names unknown passes: {', '.join(sorted(unknown))}",
                                       "run `eagle-export passes` for the list")
            pass_records = prepare_pair(target, drafter, passes_skipping(skip))
            release_freed_memory()  # the q/k/v and gate/up weights the passes fused, kept by the C heap otherwise

        with log("quantize"):
            if precision["target"] in QUANTIZED or precision["drafter"] in QUANTIZED:
                target, drafter, quant_report = quantize_stage(recipe, target, drafter, target_dir)
            else:
                quant_report = {"skipped": f"target {precision['target']}, drafter {precision['drafter']}"}

        with log("export ONNX (graph passes + TensorRT lint)"):
            models = {"target": built_target(target, str(target_dir), precision["target"], target_dtype),
                      "drafter": built_drafter(drafter, str(drafter_dir), precision["drafter"], drafter_dtype)}
            engine_specs = graph_specs(recipe, target, drafter)
            np.save(tmp / "draft_to_target.npy",
                    drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size)).numpy())
            # From here on the build holds no model: the export frees the target before the drafter's
            # graph (one proto in torch's exporter, ~3 x its weights, would sit beside the whole target),
            # and validation loads the unquantized pair again from the sources, hashed first.
            pair = [target, drafter]
            del target, drafter
            graphs = export_stage(recipe, tmp, pair, echo)
            release_freed_memory()
            keep_large_blocks_in_heap()
            for name in TOKENIZER_FILES:
                if (target_dir / name).is_file():
                    shutil.copy(target_dir / name, tmp / name)

        with log("TensorRT engines"):
            if has_trt:
                engines, skipped = build_engines(recipe, tmp, engine_specs), None
            else:
                engines, skipped = [], f"{no_trt_reason}: stopped after the ONNX stage; this build runs on ONNX Runtime"
                echo(f"  {skipped}")

        manifest = Manifest(
            recipe=recipe.data, speculation=recipe.speculation, sampling=sampling,
            max_context=recipe["profiles"]["context"]["max"],
            target=models["target"], drafter=models["drafter"],
            graphs=graphs, engines=tuple(engines) if has_trt else (), engines_skipped=None if has_trt else skipped,
            backends=(("tensorrt",) if has_trt else ()) + (() if "nvfp4" in model_precisions else ("onnxruntime",))
            + (() if "fp8" in model_precisions else ("torch",)),
            source_files=source_files,
            passes={"model": [r.to_json() for r in pass_records], "skipped_by_recipe": sorted(skip)},
            quantization=quant_report, conformance=conformance_record)
        with log("validate"):
            manifest = write_manifest(tmp, replace(manifest, stage_seconds=log.seconds))  # validation reads it
            if precision["target"] in QUANTIZED:
                delta = delta_stage(recipe, tmp, target_dir)
                echo(f"  delta {delta['delta']:.3g} (p99.9 of the top-2 margin's shift between call widths "
                     f"{delta['widths'][0]} and {delta['widths'][1]}; max |logit difference| "
                     f"{delta['max_logit_difference']:.3g}, {delta['argmax_flips']} argmax flips in {delta['positions']})")
                manifest = write_manifest(tmp, replace(manifest, quantization={**quant_report, "delta": delta},
                                                       stage_seconds=log.seconds))
            manifest = replace(manifest, validation=validate_build_dir(tmp, quick=True))
            if not manifest.validation["ok"]:
                raise EagleExportError("the build failed its own validation: "
                                       + "; ".join(manifest.validation["failures"]),
                                       "report this with the recipe; nothing was written")
        with log("manifest"):
            manifest = write_manifest(tmp, replace(manifest, stage_seconds=log.seconds))
    return manifest


def _onnx_pass_names() -> set[str]:
    return {p.name for p in onnx_pipeline().passes}


def built_target(target, source: str, precision: str, dtype: str) -> BuiltModel:
    t = target.config
    return BuiltModel(source, precision, dtype, t.hidden_size, t.num_kv_heads, t.head_dim, t.num_layers,
                      tuple(target.aux_layer_ids),
                      tuple(t.eos_token_id) if isinstance(t.eos_token_id, list) else t.eos_token_id,
                      vocab_size=t.vocab_size, max_positions=t.max_position_embeddings, architecture=t.architecture)


def built_drafter(drafter, source: str, precision: str, dtype: str) -> BuiltModel:
    d = drafter.config
    return BuiltModel(source, precision, dtype, d.hidden_size, d.num_kv_heads, d.head_dim,
                      eagle_version=d.eagle_version, draft_vocab_size=d.draft_vocab_size)


def graph_specs(recipe: Recipe, target, drafter) -> dict[str, C.GraphSpec]:
    """The contract of each graph an engine is built from (the greedy drafter's)."""
    return {"target": C.target_graph(target.config, len(target.aux_layer_ids), recipe["sampling"]),
            "drafter": C.drafter_graph(drafter.config, recipe.speculation, False)}


def build_engines(recipe: Recipe, build_dir: Path, specs: dict[str, C.GraphSpec]) -> list[Engine]:
    """Serialize one engine per graph for this GPU (only reached where TensorRT and CUDA exist)."""
    import tensorrt

    gpu = gpu_info()
    engines = []
    for graph, spec in specs.items():
        name = engine_file_name(graph, gpu["compute_capability"], tensorrt.__version__)
        profiles = engine_profiles(spec, recipe.speculation, recipe["profiles"], graph)
        build_engine(build_dir / f"{graph}.onnx", build_dir / name, profiles,
                     workspace_bytes=recipe["engine"]["workspace_gib"] << 30,
                     timing_cache_path=build_dir / "timing.cache")
        engines.append(Engine(graph, name, tensorrt.__version__, gpu["compute_capability"], gpu["name"]))
    return engines
