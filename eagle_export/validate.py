"""`eagle-export validate`: re-check a build's artifacts against their sources.

1. every artifact's sha256 against the manifest, and the source checkpoints' (the torch models of
   step 2 are rebuilt from them: changed sources fail here, instead of the graphs failing below);
2. the ONNX graphs against the torch modules they came from (rebuilt from the recorded sources
   with the same passes), on the same inputs: ids identical, values within the dtype's tolerance;
   a quantized graph, whose quantized torch module is gone, against the unquantized torch model
   on the held-out prompts the build recorded: its greedy (draft) ids must agree with it about as
   often as the torch fake-quantized model's did at build time;
3. the lossless loop, speculative against plain decoding through the same target: an unquantized
   target's tokens are identical (and, unquantized builds, equal to the torch target's greedy ones);
   a quantized target's are each within the build's eps of the argmax of the target run one token at
   a time over their own prefix (`teacher_forced.py`), and eps is small beside the target's top-2
   margins. It runs in ONNX Runtime, or for NVFP4 (no FP4 kernels there) on torch over the graphs'
   own NVFP4 weights; the check's name says which. A build with engines runs the same loop on
   TensorRT too (skipped where they cannot load).

A check is (name, ok, detail) with ok True, False or None; None is a check that could not run
here, the reason in detail: it is reported as skipped, never counted as passed.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from . import contract as C
from .backends import ort_session, run_graph, run_onnx
from .build_dir import open_build, torch_models
from .errors import EagleExportError
from .layers import causal_mask
from .manifest import MANIFEST, Agreement, Manifest, read_manifest, verify_artifacts, verify_sources
from .progress import track
from .quantize import drafter_calibration_batches
from .reference import draft_chain
from .runtime import GenerationConfig
from .teacher_forced import MARGIN_PERCENTILE, agreement, margin_percentile, teacher_forced
from .tree import random_verify_mask
from .unrolled import TargetGraph, UnrolledDrafter

# max |onnx - torch| / max |torch| allowed for logits and draft probabilities, by export dtype
TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 5e-2}
CHECK_PROMPTS = ("Explain what a speculative decoder does.", "Write a haiku about autumn.",
                 "List three prime numbers.")
# A quantized graph may agree with the unquantized model this much less often than the torch
# fake-quantized model did at build time, for the graph's own rounding.
AGREEMENT_MARGIN = 0.05
# The random graph inputs' sizes: other than the export example's, so the dynamic axes are exercised.
CHECK_SIZES = {C.BATCH: 2, C.TOKENS: 5, C.PAST: 6}
# A checked drafter position is a graph row as wide as its prompt, so checking them all would cost
# quadratically in the prompt length: these many per prompt, evenly spaced, the last included.
DRAFTER_POSITIONS = 32


def _numerics(build_dir: Path, manifest: Manifest, target, drafter, skip=()) -> list[tuple[str, bool, str]]:
    """The graphs of the roles not in `skip` (the unquantized ones) against their torch modules, on
    random inputs, in ONNX Runtime as the runtime runs them (graph optimizations on)."""
    generator = torch.Generator().manual_seed(0)
    dtype = manifest.target.dtype
    tol = TOLERANCE[dtype]
    checks = []
    if "target" not in skip:
        spec = C.target_graph(target.config, len(target.aux_layer_ids), manifest.target_graph.return_logits)
        session = ort_session(build_dir / manifest.target_graph.file)
        module = TargetGraph(target, C.LOGITS in spec.output_names)
        agree, aux_err = 1.0, 0.0
        for tree in (False, True):  # a causal call (prefill, chain) and a token tree's verify call
            mask = random_verify_mask(CHECK_SIZES[C.BATCH], CHECK_SIZES[C.TOKENS], generator) if tree else None
            args = C.example_args(spec, CHECK_SIZES, generator, target.embed_tokens.weight.dtype, mask)
            with torch.no_grad():
                expected = dict(zip(spec.output_names, module(*args)))
            got = run_onnx(session, spec.feeds(args))
            agree = min(agree, (got[C.GREEDY_IDS] == expected[C.GREEDY_IDS]).float().mean().item())
            aux_err = max(aux_err, ((got[C.AUX_HIDDEN].float() - expected[C.AUX_HIDDEN].float()).abs().max()
                                    / expected[C.AUX_HIDDEN].float().abs().max()).item())
        ok = (agree == 1.0 if dtype == "fp32" else agree >= 0.995) and aux_err <= tol
        checks.append(("target graph vs torch", ok, f"greedy agreement {agree:.4f}, aux rel. error {aux_err:.2e} "
                                                    f"(tolerance {tol:g}; causal and tree-masked calls)"))
    if "drafter" not in skip:
        graph = UnrolledDrafter(drafter, manifest.speculation, False)
        spec = C.drafter_graph(drafter.config, graph.tree, False)
        args = C.example_args(spec, {**CHECK_SIZES, C.TOKENS: graph.depth + 1}, generator, drafter.fc.weight.dtype)
        with torch.no_grad():
            expected = dict(zip(spec.output_names, graph(*args)))
        got = run_onnx(ort_session(build_dir / manifest.drafter_graph.file), spec.feeds(args))
        agree = (got[C.DRAFT_IDS] == expected[C.DRAFT_IDS]).float().mean().item()
        prob_err = (got[C.DRAFT_TOKEN_PROBS].float() - expected[C.DRAFT_TOKEN_PROBS].float()).abs().max().item()
        ok = (agree == 1.0 if dtype == "fp32" else agree >= 0.995) and prob_err <= max(tol, 1e-4)
        checks.append(("drafter graph vs torch", ok, f"draft-id agreement {agree:.4f}, prob. error {prob_err:.2e}"))
    return checks


def _agreement_check(role: str, measured: Agreement, recorded_prompts: int, agree: float, prompts: int,
                     positions: int) -> tuple:
    """Pass at AGREEMENT_MARGIN below the build-time agreement, and 3 standard errors lower when
    only some of its positions were checked (quick: one prompt; drafter: a sample of each), as one
    prompt's agreement strays from the average by far more than the margin on small models.
    Checking every recorded position leaves no sampling allowance (finite population correction)."""
    p, total = measured.top1_agreement, measured.positions
    sampling = 3 * math.sqrt(p * (1 - p) / positions * max(0.0, 1 - positions / total))
    floor = p - AGREEMENT_MARGIN - sampling
    return (f"quantized {role} graph vs unquantized torch", agree >= floor,
            f"{'greedy' if role == 'target' else 'step-0 draft'} agreement {agree:.4f} at {positions} positions "
            f"of {prompts}/{recorded_prompts} prompts; torch fake-quant {p:.4f} at all {total} at build time; "
            f"pass >= {floor:.4f} (margin {AGREEMENT_MARGIN:g} + sampling {sampling:.3f})")


@torch.no_grad()
def quantized_target_check(build_dir: Path, manifest: Manifest, target, prompts: list[list[int]]) -> tuple:
    """target.onnx's greedy ids against the unquantized torch target's argmax over every position
    of the prompts' prefills (the positions manifest.quantization.target.top1_agreement covers)."""
    # One right-padded batch, one graph run: causal attention keeps the padding out of every
    # real position, and an NVFP4 graph is loaded into onnx.reference once.
    lengths = torch.tensor([len(p) for p in prompts])
    ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, :len(p)] = torch.tensor(p)
    positions = torch.arange(ids.shape[1]).repeat(len(prompts), 1)
    past_key, past_value = target.empty_cache(len(prompts), 0)
    args = (ids, positions, past_key, past_value, torch.zeros(len(prompts), dtype=torch.long))
    spec = C.target_graph(target.config, len(target.aux_layer_ids), manifest.target_graph.return_logits)
    got = run_graph(build_dir / manifest.target_graph.file,
                    spec.feeds((*args, causal_mask(len(prompts), ids.shape[1]))))[C.GREEDY_IDS]
    expected = target(*args)[0].argmax(-1)
    real = positions < lengths[:, None]
    agree = float((got == expected)[real].float().mean())
    return _agreement_check("target", manifest.target.agreement, len(manifest.evaluation_prompts), agree,
                            len(prompts), int(real.sum()))


@torch.no_grad()
def quantized_drafter_check(build_dir: Path, manifest: Manifest, target, drafter, prompts: list[list[int]]) -> tuple:
    """drafter.onnx's step-0 draft ids against the unquantized torch drafter's, both on the
    unquantized target's aux states (as manifest.quantization.drafter.top1_agreement was measured)."""
    spec = C.drafter_graph(drafter.config, manifest.speculation, False)
    dtype = drafter.fc.weight.dtype
    agree, total = 0, 0
    for ids, aux in drafter_calibration_batches(target, prompts):
        width = ids.shape[1]
        expected = drafter.to_target_ids(draft_chain(drafter, ids, aux.to(dtype), 1).step0_logits[0].argmax(-1))
        # One graph row per checked position: the whole prompt with num_valid = position + 1, so
        # the graph's first draft is its step-0 draft at that position.
        rows = torch.linspace(width - 1, 0, min(DRAFTER_POSITIONS, width)).round().long().unique()
        k, v = drafter.empty_cache(len(rows), 0)
        args = (ids.repeat(len(rows), 1), aux.to(dtype).repeat(len(rows), 1, 1), rows + 1, k, v,
                torch.zeros(len(rows), dtype=torch.long))
        got = run_graph(build_dir / manifest.drafter_graph.file, spec.feeds(args))[C.DRAFT_IDS][:, 0]
        agree += int((got == expected[rows]).sum())
        total += len(rows)
    return _agreement_check("drafter", manifest.drafter.agreement, len(manifest.evaluation_prompts), agree / total,
                            len(prompts), total)


def _quantized_graphs(build_dir: Path, manifest: Manifest, target, drafter, roles: set[str], quick: bool) -> list:
    """The quantized roles' graphs against the unquantized torch models, on the build's held-out prompts."""
    prompts = [list(p) for p in manifest.evaluation_prompts]
    if not prompts:
        return [(f"quantized {role} graph vs unquantized torch", None,
                 "the build recorded no evaluation prompt ids (made by an older eagle-export): rebuild to check")
                for role in sorted(roles, reverse=True)]
    # NVFP4 graphs run in onnx.reference, slow on a large model: quick checks one prompt.
    prompts = prompts[:1] if quick else prompts
    checks = []
    if "target" in roles:
        checks.append(quantized_target_check(build_dir, manifest, target, prompts))
    if "drafter" in roles:
        checks.append(quantized_drafter_check(build_dir, manifest, target, drafter, prompts))
    return checks


def lossless_backend(precisions) -> str:
    """The backend the lossless loop runs on, on any machine: ONNX Runtime over the build's graphs;
    for NVFP4, which ONNX Runtime has no kernels for, torch over the graphs' own NVFP4 weights."""
    return "torch" if "nvfp4" in precisions else "onnxruntime"


def _lossless(build_dir: Path, manifest: Manifest, target, prompts_count: int, new_tokens: int,
              backend: str | None = None):
    """Speculative decoding through the build's graphs against plain decoding through the same target
    graph, batch `prompts_count`: equal token for token (unquantized targets, also equal to the torch
    target's greedy decoding when `target` is given), or, for a quantized target, every token within
    the teacher-forced contract (`teacher_forced.py`). `backend` None: `lossless_backend`. Returns
    (checks, record for the manifest)."""
    # The fixed policy verifies every draft, so every round exercises accept and rollback.
    backend = backend or lossless_backend({m.precision for m in manifest.models.values()})
    try:
        opened = open_build(build_dir, backend=backend, verify=False, depth_policy="fixed")
    except EagleExportError as e:
        if backend != "tensorrt":
            raise
        return [("lossless loop (tensorrt)", None, f"not run: the engines do not load here: {e.problem}")], None
    if opened.tokenizer is not None:
        prompts = [opened.encode(p) for p in CHECK_PROMPTS[:prompts_count]]
    else:
        prompts = [[1 + i, 7, 11 + 2 * i] for i in range(prompts_count)]
    config = GenerationConfig(max_new_tokens=new_tokens)
    spec = opened.runtime.generate(prompts, config, speculative=True)
    ar = opened.runtime.generate(prompts, config, speculative=False)
    backend = opened.runtime.backend.name
    records = [{"tokens": len(s.tokens), "tau": round(s.stats.tau, 4), **agreement(s.tokens, a.tokens)}
               for s, a in zip(spec, ar)]
    tau = sum(r.stats.tau for r in spec) / len(spec)
    detail = f"{len(prompts)} prompts x {new_tokens} tokens, batch {len(prompts)}, tau {tau:.2f}"
    if manifest.target.quantized:
        return _teacher_forced_checks(opened, manifest, prompts, spec, records, detail, tau)
    same = all(s.tokens == a.tokens for s, a in zip(spec, ar))
    if not same:  # where each prompt first parts ways tells a numerics flip from a broken loop
        detail += "; first differing token per prompt: " + ", ".join(
            "-" if r["first_divergence"] is None else str(r["first_divergence"]) for r in records)
    checks = [(f"lossless: speculative == autoregressive ({backend})", same, detail)]
    if target is not None:
        torch_greedy = all(s.tokens == target.generate_greedy(p, new_tokens)
                           for s, p in track(zip(spec, prompts), "torch greedy", len(prompts)))
        checks.append((f"lossless: speculative ({backend}) == torch target greedy", torch_greedy,
                       f"{len(prompts)} prompts x {new_tokens} tokens"))
    return checks, {"contract": "token-identical", "backend": backend, "tau": round(tau, 4), "prompts": records}


def _teacher_forced_checks(opened, manifest: Manifest, prompts, spec, records, detail, tau):
    """A quantized target's lossless checks: every speculative token within eps of the width-1
    target's argmax over its own prefix, and eps small beside the target's top-2 margins."""
    backend = opened.runtime.backend
    name = f"lossless: teacher-forced within eps ({backend.name})"
    eps = manifest.eps
    if eps is None:
        return [(name, False, "the build recorded no eps (made by an older eagle-export): rebuild it")], None
    shape = (manifest.target.num_layers, manifest.target.num_kv_heads, manifest.target.head_dim)
    margins, outside = [], 0
    for record, prompt, result in track(list(zip(records, prompts, spec)), "teacher forcing", len(prompts)):
        forced = teacher_forced(backend, shape, prompt, result.tokens, eps)
        margins += forced["margins"]
        outside += len(forced["violations"])
        record.update(exceptions=forced["exceptions"], violations=forced["violations"])
    p10 = margin_percentile(margins)
    per_prompt = "; ".join(
        f"prompt {i}: match {r['match_fraction']:.2f}, first divergence "
        f"{'-' if r['first_divergence'] is None else r['first_divergence']}, "
        f"{len(r['exceptions'])} near-tie(s)" + "".join(f" [{e['index']}: margin {e['margin']:.3g}]"
                                                        for e in r["exceptions"])
        + (f", {len(r['violations'])} OUTSIDE" + "".join(f" [{v['index']}: margin {v['margin']:.3g}]"
                                                        for v in r["violations"]) if r["violations"] else "")
        for i, r in enumerate(records))
    exceptions = sum(len(r["exceptions"]) for r in records)
    checks = [
        (name, outside == 0, f"{detail}; eps {eps:.3g}; {outside} token(s) outside, {exceptions} near-tie "
                             f"exception(s); exact agreement with autoregressive: {per_prompt}"),
        (f"lossless: eps below the target's top-2 margins ({backend.name})", eps <= p10,
         (f"eps {eps:.3g} <= {p10:.3g}" if eps <= p10 else
          f"too noisy to verify: eps {eps:.3g} exceeds {p10:.3g}")
         + f", the {MARGIN_PERCENTILE}th percentile of the target's top-2 logit margins at the {len(margins)} "
           "teacher-forced positions"),
    ]
    record = {"contract": "teacher-forced", "backend": backend.name, "eps": eps,
              "margin_p10": round(p10, 6), "positions": len(margins),
              "tau": round(tau, 4), "prompts": records}
    return checks, record


class _Checks(list):
    """The checks so far; each is handed to `on_check(name, ok, detail)` as it is added, so `validate`
    prints it when it finishes instead of after the last one."""

    def __init__(self, on_check=None):
        super().__init__()
        self.on_check = on_check

    def append(self, check) -> None:
        super().append(check)
        if self.on_check is not None:
            name, ok, detail = check
            self.on_check(name, None if ok is None else bool(ok), detail)

    def __iadd__(self, more):
        for check in more:
            self.append(check)
        return self


def validate_build_dir(build_dir, reference=None, quick: bool = False, on_check=None) -> dict:
    """Run every check; `reference` = the unquantized (target, drafter) torch modules the build was
    made from, when the caller has them (else they are rebuilt from the recorded sources); `on_check`
    sees each check as it finishes."""
    build_dir = Path(build_dir)
    data = read_manifest(build_dir)
    checks = _Checks(on_check)
    problems = verify_artifacts(build_dir, data)  # before any field is read: an edited manifest is not trusted
    checks.append(("artifact hashes", not problems, "; ".join(problems) or
                   f"{len(data['artifacts'])} files and the manifest match"))
    if problems:  # nothing else is trustworthy
        return _summary(checks)
    manifest = Manifest.from_json(data, build_dir / MANIFEST)
    quantized = manifest.quantized_roles
    if reference is None:
        changed, unavailable = verify_sources(manifest)
        if changed or unavailable:  # the graphs cannot be compared with models other than their own
            checks.append(("source checkpoints", False if changed else None,
                           "; ".join(changed + unavailable) + ": graphs not compared with torch"))
        else:
            checks.append(("source checkpoints", True, "every file has the sha256 the build recorded"))
            reference = torch_models(manifest)
    if reference is not None:
        checks += _numerics(build_dir, manifest, *reference, skip=quantized)
        if quantized:
            checks += _quantized_graphs(build_dir, manifest, *reference, quantized, quick)
    target = None if quantized or reference is None else reference[0]
    size = (2, 16) if quick else (3, 32)
    try:
        lossless, record = _lossless(build_dir, manifest, target, *size)
    except EagleExportError as e:  # the torch backend of an NVFP4 build needs its unchanged sources
        lossless, record = [("lossless loop", False, f"could not run: {e.problem}")], None
    checks += lossless
    if manifest.engines:  # the engines the build made run the same loop (skipped where they cannot load)
        checks += _lossless(build_dir, manifest, target, *size, backend="tensorrt")[0]
    return {**_summary(checks), "lossless": record}


def _summary(checks) -> dict:
    """ok None (skipped) is neither a pass nor a failure: it is listed on its own."""
    checks = [(name, None if ok is None else bool(ok), detail) for name, ok, detail in checks]  # no numpy bools
    status = {True: "passed", False: "failed", None: "skipped"}
    failures = [f"{name}: {detail}" for name, ok, detail in checks if ok is False]
    return {"ok": not failures, "failures": failures,
            "skipped": [f"{name}: {detail}" for name, ok, detail in checks if ok is None],
            "checks": [{"name": n, "ok": ok, "status": status[ok], "detail": d} for n, ok, d in checks]}


def validate(build_dir, on_check=None) -> dict:
    """The CLI's entry: a missing or unreadable build is an error, failed checks are a report."""
    if not Path(build_dir).is_dir():
        raise EagleExportError(f"{build_dir} is not a directory", "pass a build directory made by `eagle-export build`")
    return validate_build_dir(build_dir, on_check=on_check)
