"""`eagle-export validate`: re-check a build's artifacts against their sources.

1. every artifact's sha256 against the manifest;
2. the ONNX graphs against the torch modules they came from (rebuilt from the recorded sources
   with the same passes), on the same inputs: ids identical, values within the dtype's tolerance;
3. the lossless loop: speculative decoding through the build's graphs equals target-only greedy
   decoding through the same target graph, and (unquantized builds) the torch target's own.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import EagleExportError
from .manifest import read_manifest, verify_artifacts
from .runtime import GenerationConfig

# max |onnx - torch| / max |torch| allowed for logits and draft probabilities, by export dtype
TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 5e-2}
CHECK_PROMPTS = ("Explain what a speculative decoder does.", "Write a haiku about autumn.",
                 "List three prime numbers.")


def _random_inputs(target, drafter, depth: int, batch: int = 2, past: int = 6, tokens: int = 5):
    """Seeded, non-trivial graph inputs: random ids, cache contents and aux states, ragged lengths."""
    g = torch.Generator().manual_seed(0)
    t, d = target.config, drafter.config
    dtype = target.embed_tokens.weight.dtype
    lens = torch.tensor([past, past // 2])[:batch]
    cache = torch.randn(t.num_layers, batch, t.num_kv_heads, past, t.head_dim, generator=g).to(dtype)
    target_args = (torch.randint(0, t.vocab_size, (batch, tokens), generator=g), lens[:, None] + torch.arange(tokens),
                   cache, torch.randn(cache.shape, generator=g).to(dtype), lens)
    width = depth + 1
    dcache = torch.randn(1, batch, d.num_kv_heads, past, d.head_dim, generator=g).to(dtype)
    aux = torch.randn(batch, width, d.num_aux * d.target_hidden_size, generator=g)
    drafter_args = (torch.randint(0, t.vocab_size, (batch, width), generator=g), aux.to(dtype),
                    torch.tensor([width, 2])[:batch], dcache, torch.randn(dcache.shape, generator=g).to(dtype), lens)
    return target_args, drafter_args


def _numerics(build_dir: Path, manifest: dict, target, drafter) -> list[tuple[str, bool, str]]:
    from . import contract as C
    from .export import ort_session, run_onnx
    from .unrolled import TargetGraph, UnrolledDrafter

    target_args, drafter_args = _random_inputs(target, drafter, manifest["depth"])

    dtype = manifest["models"]["target"]["dtype"]
    tol = TOLERANCE[dtype]
    checks = []
    spec = C.target_graph(target.config, len(target.aux_layer_ids), manifest["graphs"]["target"]["return_logits"])
    args = target_args
    with torch.no_grad():
        expected = dict(zip(spec.output_names, TargetGraph(target, C.LOGITS in spec.output_names)(*args)))
    got = run_onnx(ort_session(build_dir / "target.onnx"), spec, args)
    agree = (got[C.GREEDY_IDS] == expected[C.GREEDY_IDS]).float().mean().item()
    aux_err = ((got[C.AUX_HIDDEN].float() - expected[C.AUX_HIDDEN].float()).abs().max()
               / expected[C.AUX_HIDDEN].float().abs().max()).item()
    ok = (agree == 1.0 if dtype == "fp32" else agree >= 0.995) and aux_err <= tol
    checks.append(("target graph vs torch", ok, f"greedy agreement {agree:.4f}, aux rel. error {aux_err:.2e} "
                                                f"(tolerance {tol:g})"))
    depth = manifest["depth"]
    spec = C.drafter_graph(drafter.config, depth, False)
    args = drafter_args
    with torch.no_grad():
        expected = dict(zip(spec.output_names, UnrolledDrafter(drafter, depth, False)(*args)))
    got = run_onnx(ort_session(build_dir / "drafter.onnx"), spec, args)
    agree = (got[C.DRAFT_IDS] == expected[C.DRAFT_IDS]).float().mean().item()
    prob_err = (got[C.DRAFT_TOKEN_PROBS].float() - expected[C.DRAFT_TOKEN_PROBS].float()).abs().max().item()
    ok = (agree == 1.0 if dtype == "fp32" else agree >= 0.995) and prob_err <= max(tol, 1e-4)
    checks.append(("drafter graph vs torch", ok, f"draft-id agreement {agree:.4f}, prob. error {prob_err:.2e}"))
    return checks


def _lossless(build_dir: Path, manifest: dict, target, prompts_count: int, new_tokens: int):
    from .session import open_build

    opened = open_build(build_dir, backend="onnxruntime", verify=False)
    if opened.tokenizer is not None:
        prompts = [opened.encode(p) for p in CHECK_PROMPTS[:prompts_count]]
    else:
        prompts = [[1 + i, 7, 11 + 2 * i] for i in range(prompts_count)]
    config = GenerationConfig(max_new_tokens=new_tokens)
    spec = opened.runtime.generate(prompts, config, speculative=True)
    ar = opened.runtime.generate(prompts, config, speculative=False)
    same = all(s.tokens == a.tokens for s, a in zip(spec, ar))
    tau = sum(r.stats.tau for r in spec) / len(spec)
    checks = [("lossless: speculative == autoregressive (onnxruntime)", same,
               f"{len(prompts)} prompts x {new_tokens} tokens, batch {len(prompts)}, tau {tau:.2f}")]
    if target is not None:
        torch_greedy = all(s.tokens == target.generate_greedy(p, new_tokens) for s, p in zip(spec, prompts))
        checks.append(("lossless: speculative (onnxruntime) == torch target greedy", torch_greedy,
                       f"{len(prompts)} prompts x {new_tokens} tokens"))
    return checks


def validate_build_dir(build_dir, reference=None, quick: bool = False) -> dict:
    """Run every check; `reference` = (target, drafter) torch modules when the caller has them."""
    build_dir = Path(build_dir)
    manifest = read_manifest(build_dir)
    checks = []
    problems = verify_artifacts(build_dir, manifest)
    checks.append(("artifact hashes", not problems, "; ".join(problems) or
                   f"{len(manifest['artifacts'])} files match the manifest"))
    if problems:  # nothing else is trustworthy
        return _summary(checks)
    precisions = {manifest["models"][m]["precision"] for m in ("target", "drafter")}
    quantized = bool(precisions & {"fp8", "nvfp4"})
    if reference is None and not quantized:
        from .session import torch_models

        reference = torch_models(manifest)
    if not quantized:
        checks += _numerics(build_dir, manifest, *reference)
    else:
        checks.append(("graphs vs torch", True, "quantized build: its metrics against the unquantized "
                                                "reference were recorded at build time (manifest.quantization)"))
    if "nvfp4" in precisions:
        checks.append(("lossless loop", True, "skipped: ONNX Runtime has no FP4 kernels on this machine"))
    else:
        target = None if quantized else reference[0]
        checks += _lossless(build_dir, manifest, target, 2 if quick else 3, 16 if quick else 32)
    return _summary(checks)


def _summary(checks) -> dict:
    failures = [f"{name}: {detail}" for name, ok, detail in checks if not ok]
    return {"ok": not failures, "failures": failures,
            "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in checks]}


def validate(build_dir) -> dict:
    """The CLI's entry: a missing or unreadable build is an error, failed checks are a report."""
    if not Path(build_dir).is_dir():
        raise EagleExportError(f"{build_dir} is not a directory", "pass a build directory made by `eagle-export build`")
    return validate_build_dir(build_dir)
