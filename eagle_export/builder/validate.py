"""`eagle-export validate`: re-check a build's artifacts against their sources.

1. every artifact's sha256 against the manifest, and the source checkpoints' (the torch models of
   step 2 are rebuilt from them: changed sources fail here, instead of the graphs failing below);
2. the ONNX graphs against the torch modules they came from (rebuilt from the recorded sources
   with the same passes), on the same inputs: ids identical, values within the dtype's tolerance;
   a quantized graph, whose quantized torch module is gone, against the unquantized torch model
   on the held-out prompts the build recorded: its greedy (draft) ids must agree with it about as
   often as the torch fake-quantized model's did at build time;
3. the lossless contract, in tiers, through the build's graphs (fixed policy):
   T0  synthetic drafters (`synthetic.py`: oracle, anti, random; batch 1 and a ragged 3): output
       equal to the reference, oracle tau = K+1, anti tau = 1. The reference is greedy decoding
       through the verify graph with every draft rejected, and for an fp32/fp16/bf16 target it must
       equal plain decoding;
   an fp32/fp16/bf16 target: speculative tokens identical to plain decoding's (and, unquantized
       builds, to the torch target's greedy ones);
   a quantized target (FP8, NVFP4), whose logits depend on the call width:
   T1  speculative tokens identical to that verify-width reference (the `anti` drafter's output);
       "not applicable" (skipped, with the difference found) where the backend gives a row other
       bits at another place in the call, in the runs' layouts (`teacher_forced.position_variance`);
   T2  each prompt's first divergence from width-1 decoding explained (`teacher_forced.py`): a
       near-tie below the build's delta, the speculative token within delta of the reference's
       top (any rank), the verify width's argmax;
   T3  tau of the quantized pair within 5% of the unquantized pair's, and of the quantized drafter
       within 5% of its unquantized self (measured by the build, same prompts, same run).
   It runs in ONNX Runtime, or for NVFP4 (no FP4 kernels there) on torch over the graphs' own
   NVFP4 weights; each check's name says which. A build with engines runs the same tiers on
   TensorRT too (skipped where they cannot load). A tier an older build cannot run is skipped, and
   says why.

A check is (name, ok, detail) with ok True, False or None; None is a check that could not run
here, the reason in detail: it is reported as skipped, never counted as passed.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..errors import EagleExportError
from ..export.unrolled import TargetGraph, UnrolledDrafter
from ..models import contract as C
from ..models.layers import causal_mask
from ..progress import track
from ..quantize.quantize import drafter_calibration_batches
from ..runtime.backends import ort_session, run_graph, run_onnx
from ..runtime.runtime import GenerationConfig
from ..speculation.eager import draft_chain
from ..speculation.stats import mean_accepted_length
from ..speculation.synthetic import MODES, SyntheticDrafts
from ..speculation.tree import random_verify_mask
from .build_dir import check_exact, open_build, torch_models
from .manifest import (
    Agreement,
    BuildMismatch,
    Manifest,
    check_build,
    contradictions,
    old_format_note,
    verify_sources,
)
from .teacher_forced import agreement, explain_divergence, position_variance

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


# T0's runs: few tokens, so validate stays quick; batch 1 and a ragged batch of 3 prompts.
T0_NEW_TOKENS = 8
# T3: the quantized pair's tau may fall this much (relative) below the unquantized pair's.
TAU_TOLERANCE = 0.05


class CallLog:
    """The target and drafter calls a runtime's backend makes while in use, recorded (copied) in order
    as (kind, tensors) without changing them: a target call's ids, positions, tree mask and aux
    states; a drafter call's ids, aux states, valid-row counts and cache lengths."""

    TARGET = (C.INPUT_IDS, C.POSITIONS, C.TREE_MASK)
    DRAFTER = (C.INPUT_IDS, C.AUX_HIDDEN, C.NUM_VALID, C.CACHE_LENS)

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def _recording(self, kind, call, names, outputs=()):
        def recorded(feeds, **kw):
            tensors = {name: feeds[name].cpu().clone() for name in names}  # the runtime writes its buffers in place
            out = call(feeds, **kw)
            self.calls.append((kind, {**tensors, **{name: out[name].cpu().clone() for name in outputs}}))
            return out
        return recorded

    def __enter__(self):
        self.own = {name: vars(self.backend).get(name) for name in ("target", "drafter")}  # set on the instance
        self.backend.target = self._recording("target", self.backend.target, self.TARGET, (C.AUX_HIDDEN,))
        self.backend.drafter = self._recording("drafter", self.backend.drafter, self.DRAFTER)
        return self

    def __exit__(self, *exc):
        for name, own in self.own.items():
            if own is None:
                delattr(self.backend, name)  # the class's method again
            else:
                setattr(self.backend, name, own)


def drafter_input_problems(calls: list, prompts: list[list[int]], outputs: list[list[int]]) -> list[str]:
    """Whether every drafter call was fed the accepted path's rows, derived afresh from the recorded
    target calls and each sequence's final tokens s = prompt + output, never from the runtime's own
    bookkeeping: the row for position p is (s[p+1], the aux state the target computed for p in its
    latest call whose row at p, and each of that row's ancestors (tree mask), holds the token s has
    there). Drafter row i of sequence b is position cache_lens[b] + i; rows at committed positions
    (below the next verify call's root position) with a known next token are compared, ids equal and
    aux states bit for bit. A stale or misplaced aux row changes only the drafts, which greedy
    verification then rejects, so the output alone never shows it."""
    problems = []
    for b, (prompt, output) in enumerate(zip(prompts, outputs)):
        seq = list(prompt) + list(output)
        aux_at: dict[int, torch.Tensor] = {}
        for index, (kind, t) in enumerate(calls):
            if kind == "target":
                ids, positions, mask = t[C.INPUT_IDS][b], t[C.POSITIONS][b].tolist(), t[C.TREE_MASK][b]
                known = [p < len(seq) and int(i) == seq[p] for i, p in zip(ids, positions)]
                found = set()
                for row, p in enumerate(positions):
                    on_path = all(known[a] for a in torch.nonzero(mask[row])[:, 0].tolist())
                    if on_path and p not in found:  # siblings hold distinct tokens: the first is the one
                        aux_at[p] = t[C.AUX_HIDDEN][b, row]
                        found.add(p)
                continue
            verify = next((c for kind_, c in calls[index + 1:] if kind_ == "target"), None)
            committed = int(verify[C.POSITIONS][b, 0]) if verify is not None else len(seq)
            start = int(t[C.CACHE_LENS][b])
            for row in range(int(t[C.NUM_VALID][b])):
                p = start + row
                if p >= committed or p + 1 >= len(seq):
                    continue  # not a row of this sequence's accepted path (a finished one's padding)
                aux = t[C.AUX_HIDDEN][b, row]
                if p not in aux_at:
                    problems.append(f"sequence {b}: position {p} fed to the drafter was never accepted")
                elif int(t[C.INPUT_IDS][b, row]) != seq[p + 1] or not torch.equal(aux, aux_at[p].to(aux.dtype)):
                    what = "token" if int(t[C.INPUT_IDS][b, row]) != seq[p + 1] else "aux state"
                    problems.append(f"sequence {b}: drafter call {sum(k == 'drafter' for k, _ in calls[:index])} "
                                    f"was fed a {what} at position {p} other than the accepted path's")
                if len(problems) >= 3:
                    return problems
    return problems


def _synthetic_tier(runtime, prompts, exact_plain: bool) -> tuple:
    """T0: the algorithm, exact. Per batch (the first prompt; all three, ragged), the reference is
    greedy decoding through the verify graph with every draft rejected (the `anti` drafter): for an
    fp32/fp16/bf16 target it must equal plain decoding; oracle, anti and random drafts must give the
    reference's tokens, oracle accepting every draft it verifies and anti none; and every drafter call
    (the real drafter runs under synthetic drafts) must be fed the accepted path's rows
    (`drafter_input_problems`). Returns (check, figures)."""
    config = GenerationConfig(max_new_tokens=T0_NEW_TOKENS)
    longer = GenerationConfig(max_new_tokens=T0_NEW_TOKENS + runtime.depth)  # the oracle's look-ahead
    problems, taus = [], {}
    for batch in (prompts[:1], prompts[:3]):
        plain = [r.tokens for r in runtime.generate(batch, longer, speculative=False)]
        anti = SyntheticDrafts("anti", plain, runtime.vocab_size)
        reference = [r.tokens for r in runtime.generate(batch, longer, synthetic=anti)]
        if exact_plain and reference != plain:
            problems.append(f"batch {len(batch)}: verify-width greedy differs from plain decoding")
        for mode in MODES:
            with CallLog(runtime.backend) as log:
                results = runtime.generate(batch, config,
                                           synthetic=SyntheticDrafts(mode, reference, runtime.vocab_size))
            if [r.tokens for r in results] != [ref[:T0_NEW_TOKENS] for ref in reference]:
                problems.append(f"batch {len(batch)}: {mode} drafts changed the output")
            problems += [f"batch {len(batch)}, {mode} drafts: {p}"
                         for p in drafter_input_problems(log.calls, batch, [r.tokens for r in results])]
            # rounds of sequences the reference runs past (an EOS ends the oracle's knowledge)
            rounds = [(a, d) for r, ref in zip(results, reference) if len(ref) == longer.max_new_tokens
                      for a, d in zip(r.stats.accepted, r.stats.depths)]
            if mode == "oracle" and any(a != d for a, d in rounds):
                problems.append(f"batch {len(batch)}: oracle drafts rejected ({sum(a != d for a, d in rounds)} "
                                f"of {len(rounds)} rounds)")
            if mode == "anti" and any(a for a, _ in rounds):
                problems.append(f"batch {len(batch)}: anti drafts accepted ({sum(a > 0 for a, _ in rounds)} "
                                f"of {len(rounds)} rounds)")
            taus[f"{mode}_batch{len(batch)}"] = round(sum(r.stats.tau for r in results) / len(results), 4)
    name = f"T0 synthetic drafters, exact ({runtime.backend.name})"
    reference = "plain decoding" if exact_plain else "greedy decoding at the verify width"
    detail = (f"oracle/anti/random drafts, fixed policy, batch 1 and 3 x {T0_NEW_TOKENS} tokens: output equal to "
              f"{reference}; the drafter fed the accepted path's rows (token, aux state) at every call; tau "
              + ", ".join(f"{k} {v:g}" for k, v in taus.items()) + f" (K+1 = {runtime.depth + 1})")
    if problems:
        detail += "; " + "; ".join(problems)
    return (name, not problems, detail), {"ok": not problems, "tau": taus, "problems": problems}


def _lossless(build_dir: Path, manifest: Manifest, target, prompts_count: int, new_tokens: int,
              backend: str | None = None, exact: bool = False):
    """The lossless contract's tiers through the build's graphs, batch `prompts_count` (module
    docstring): T0 always; an unquantized target's speculative tokens equal plain decoding's (and
    the torch target's greedy ones when `target` is given); a quantized target's T1-T3. `backend`
    None: `lossless_backend`; `exact`: its width-invariant kernels (torch). Returns (checks, record for the manifest)."""
    # The fixed policy verifies every draft, so every round exercises accept and rollback.
    backend = backend or lossless_backend({m.precision for m in manifest.models.values()})
    try:
        opened = open_build(build_dir, backend=backend, verify=False, verify_policy="fixed", exact=exact)
    except EagleExportError as e:
        if backend != "tensorrt":
            raise
        return [("lossless loop (tensorrt)", None, f"not run: the engines do not load here: {e.problem}")], None
    # ragged: the prompts differ in length
    prompts = ([opened.encode(p) for p in CHECK_PROMPTS] if opened.tokenizer is not None else
               [[1 + i, 7, 11 + 2 * i, 5][:2 + i] for i in range(len(CHECK_PROMPTS))])
    runtime = opened.runtime
    quantized = manifest.target.quantized
    t0, t0_record = _synthetic_tier(runtime, prompts, exact_plain=not quantized)
    prompts = prompts[:prompts_count]
    config = GenerationConfig(max_new_tokens=new_tokens)
    longer = GenerationConfig(max_new_tokens=new_tokens + runtime.depth)
    spec = runtime.generate(prompts, config, speculative=True)
    plain = [r.tokens for r in runtime.generate(prompts, longer, speculative=False)]
    ar = [p[:new_tokens] for p in plain]
    backend = runtime.backend.name + (", exact kernels" if getattr(runtime.backend, "exact", False) else "")
    records = [{"tokens": len(s.tokens), "tau": round(s.stats.tau, 4), **agreement(s.tokens, a)}
               for s, a in zip(spec, ar)]
    tau = sum(r.stats.tau for r in spec) / len(spec)
    detail = f"{len(prompts)} prompts x {new_tokens} tokens, batch {len(prompts)}, tau {tau:.2f}"
    if quantized:
        anti = runtime.generate(prompts, config, synthetic=SyntheticDrafts("anti", plain, runtime.vocab_size))
        checks, record = _quantized_tiers(opened, manifest, prompts, spec, [r.tokens for r in anti], ar, records,
                                          detail, new_tokens)
        return [t0, *checks], {**record, "tau": round(tau, 4), "t0": t0_record}
    same = all(s.tokens == a for s, a in zip(spec, ar))
    if not same:  # where each prompt first parts ways tells a numerics flip from a broken loop
        detail += "; first differing token per prompt: " + ", ".join(
            "-" if r["first_divergence"] is None else str(r["first_divergence"]) for r in records)
    checks = [t0, (f"lossless: speculative == autoregressive ({backend})", same, detail)]
    if target is not None:
        torch_greedy = all(s.tokens == target.generate_greedy(p, new_tokens)
                           for s, p in track(zip(spec, prompts), "torch greedy", len(prompts)))
        checks.append((f"lossless: speculative ({backend}) == torch target greedy", torch_greedy,
                       f"{len(prompts)} prompts x {new_tokens} tokens"))
    return checks, {"contract": "token-identical", "backend": backend, "tau": round(tau, 4), "prompts": records,
                    "t0": t0_record}


def _quantized_tiers(opened, manifest: Manifest, prompts, spec, reference, plain, records, detail, new_tokens):
    """A quantized target's T1 (speculative == greedy at the verify width, token for token), T2 (each
    divergence from width-1 decoding explained: `teacher_forced.py`) and T3 (tau kept, as the build
    measured it). Returns (checks, record)."""
    runtime = opened.runtime
    backend = runtime.backend
    width = backend.verify_width  # every draft verified: the fixed policy's
    shape = (manifest.target.num_layers, manifest.target.num_kv_heads, manifest.target.head_dim)
    first = [agreement(s.tokens, r)["first_divergence"] for s, r in zip(spec, reference)]
    t1 = all(d is None for d in first)
    t1_detail = (f"{detail}; speculative (real drafter) vs greedy through the verify graph at width {width} "
                 "(anti drafter): first differing token per prompt: " + ", ".join("-" if d is None else str(d)
                                                                                  for d in first))
    # Exactness at the verify width needs a row's bits independent of its place in the call, in the
    # layouts these runs made: probed on the same prompts, along the reference's tokens, with the
    # runtime's cache views for them (as a round reserves them: past + K + 1, within the capacity).
    capacity = runtime.capacity(prompts, new_tokens)
    variance = position_variance(backend, shape, list(zip(prompts, reference)), width,
                                 view=lambda past, _: runtime.cache_slots(past + runtime.depth + 1, capacity))
    if variance["differing"]:
        t1 = None
        low, high = variance["view_slots"]
        largest = variance["max_logit_difference"]
        t1_detail = (f"not applicable on {backend.name}: a row's bits depend on its place in a width-{width} call "
                     f"(the attention sums a row's keys as cache view + call, in an order that depends on which "
                     f"keys the call brings): {variance['differing']} of {variance['rows']} rows (logits or new K/V) "
                     f"differ between row 0 over past p and row j over past p-j, max |logit difference| "
                     f"{'- (the graph returns no logits)' if largest is None else f'{largest:.3g}'}, "
                     f"{variance['argmax_flips']} argmax flips, cache views of "
                     f"{low}-{high} slots; README: the lossless contract; T2 and T3 carry the contract here; {t1_detail}")
    elif not t1:
        t1_detail += (f"; the backend gave every one of {variance['rows']} rows the same bits at every place in the "
                      "call, so the loop is at fault")
    if variance["max_logit_difference"] is None:
        t1_detail += "; rows probed on their greedy ids and new K/V (the target graph returns no logits)"
    checks = [(f"T1 exact at the verify width ({backend.name})", t1, t1_detail)]
    record = {"contract": "tiered", "backend": backend.name, "verify_width": width,
              "t1": {"ok": t1, "first_divergence": first, "position_variance": variance}, "prompts": records}
    delta = manifest.delta
    t2_name = f"T2 divergence from width-1 decoding explained ({backend.name})"
    if delta is None:
        checks.append((t2_name, None, "not run: the build recorded no delta (made before the tiered contract): "
                                      "rebuild to run T2"))
    elif not backend.has_logits:  # a hand-made or older target graph: T2 reads each call's margins
        checks.append((t2_name, None, "not run: the target graph returns no logits, whose margins T2 reads: "
                                      "rebuild to run T2 (a quantized target's graph returns them)"))
    else:
        explained = [explain_divergence(backend, shape, p, s.tokens, a, delta, s.stats.accepted, s.stats.widths)
                     for p, s, a in track(list(zip(prompts, spec, plain)), "T2 divergences", len(prompts))]
        for r, e in zip(records, explained):
            r["t2"] = e
        ok = all(e["explained"] for e in explained)
        checks.append((t2_name, ok, f"delta {delta:.3g}; " + "; ".join(
            f"prompt {i}: {_divergence_line(e)}" for i, e in enumerate(explained))))
        record["t2"] = {"ok": ok, "delta": delta}
    *t3, record["t3"] = _tau_tier(manifest, runtime)
    checks.append(tuple(t3))
    return checks, record


def _divergence_line(e: dict) -> str:
    """One prompt's T2 record in words: where it parts from width-1 decoding, the figures there and
    the conditions that do not hold."""
    if e["d"] is None:
        line = "identical"
    else:
        line = f"d {e['d']}, margin " + ("-" if e["margin"] is None else f"{e['margin']:.3g}")
        if "gap_to_top" in e:
            line += f", width-1 rank {e['width1_rank']} at gap {e['gap_to_top']:.3g} from its top"
        line += "".join(f", NOT {k.replace('_', ' ')}" for k in
                        ("argmax_at_verify_width", "margin_below_delta", "within_delta_of_top") if e.get(k) is False)
        line += f", {e['why']}" if "why" in e else ""
    return line + f", identical prefix {e['identical_prefix']:.2f}"


def _tau_tier(manifest: Manifest, runtime) -> tuple:
    """T3: tau of this build (its graphs, fixed policy, pooled over every round) on the held-out
    prompts the build recorded, within TAU_TOLERANCE of the unquantized pair's on the same prompts
    (greedy, so deterministic: recorded by the build); and the quantized drafter's tau within
    TAU_TOLERANCE of its unquantized self's (both measured by the build, same prompts, same run)."""
    q = manifest.quantization
    name = f"T3 acceptance kept ({runtime.backend.name})"
    if "tau_reference" not in q or not manifest.evaluation_prompts:
        return name, None, "not run: the build measured no tau (evaluation.tau off, or made before it)", {}
    config = GenerationConfig(max_new_tokens=q["evaluation"]["max_new_tokens"])
    results = runtime.generate([list(p) for p in manifest.evaluation_prompts], config)
    tau = mean_accepted_length([a for r in results for a in r.stats.accepted], empty=0.0)
    figures = {"tau_build": round(tau, 4), "tau_unquantized_pair": q["tau_reference"],
               "pair_ratio": round(tau / q["tau_reference"], 4), "prompts": len(results)}
    detail = (f"tau of this build {tau:.3f} vs the unquantized pair's {q['tau_reference']:.3f} on the "
              f"{len(results)} held-out prompts (ratio {figures['pair_ratio']:.3f})")
    ok = figures["pair_ratio"] >= 1 - TAU_TOLERANCE
    if "tau_drafter_ratio" in q:
        figures["drafter_ratio"] = q["tau_drafter_ratio"]
        ok = ok and q["tau_drafter_ratio"] >= 1 - TAU_TOLERANCE
        detail += (f"; quantized drafter vs its unquantized self {q['tau_quantized']:.3f} vs "
                   f"{q['tau_unquantized_drafter']:.3f} (ratio {q['tau_drafter_ratio']:.3f}, at build)")
    elif manifest.drafter.quantized and manifest.target.quantized:
        return name, None, detail + ("; not run in full: the build did not measure the quantized drafter "
                                     "against its unquantized self (made before it): rebuild"), figures
    return name, ok, detail + f"; pass >= {1 - TAU_TOLERANCE:g}, fixed policy", figures


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


def validate_build_dir(build_dir, reference=None, quick: bool = False, on_check=None, exact: bool = False) -> dict:
    """Run every check; `reference` = the unquantized (target, drafter) torch modules the build was
    made from, when the caller has them (else they are rebuilt from the recorded sources); `on_check`
    sees each check as it finishes; `exact`: the lossless loop also runs on the torch backend's
    width-invariant kernels (refused before anything loads where they cannot run)."""
    build_dir = Path(build_dir)
    checks = _Checks(on_check)
    try:
        manifest = check_build(build_dir)  # the gate every reader passes, reported here as a check
    except BuildMismatch as e:  # nothing else is trustworthy
        checks.append(("artifact hashes", False, "; ".join(e.problems)))
        return _summary(checks)
    old = old_format_note(manifest, build_dir)
    checks.append(("artifact hashes", True,
                   f"{len(manifest.artifacts)} files and the manifest match" + (f"; {old}" if old else "")))
    contradicting = contradictions(manifest)
    if contradicting:  # whatever the hashes say, these values cannot run
        checks.append(("manifest values", False, "; ".join(contradicting)))
        return _summary(checks)
    if exact:
        check_exact(manifest, "torch")
    quantized = manifest.quantized_roles
    if reference is None:
        changed, unavailable = verify_sources(manifest)
        if changed or unavailable:  # the graphs cannot be compared with models other than their own
            checks.append(("source checkpoints", False if changed else None,
                           "; ".join(changed + unavailable) + ": graphs not compared with torch"))
        else:
            checks.append(("source checkpoints", True, "every file has the sha256 the build recorded"))
            reference = torch_models(manifest, build_dir=Path(build_dir))
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
    if exact:
        checks += _lossless(build_dir, manifest, target, *size, backend="torch", exact=True)[0]
    return {**_summary(checks), "lossless": record}


def _summary(checks) -> dict:
    """ok None (skipped) is neither a pass nor a failure: it is listed on its own."""
    checks = [(name, None if ok is None else bool(ok), detail) for name, ok, detail in checks]  # no numpy bools
    status = {True: "passed", False: "failed", None: "skipped"}
    failures = [f"{name}: {detail}" for name, ok, detail in checks if ok is False]
    return {"ok": not failures, "failures": failures,
            "skipped": [f"{name}: {detail}" for name, ok, detail in checks if ok is None],
            "checks": [{"name": n, "ok": ok, "status": status[ok], "detail": d} for n, ok, d in checks]}


def validate(build_dir, on_check=None, exact: bool = False) -> dict:
    """The CLI's entry: a missing or unreadable build is an error, failed checks are a report."""
    if not Path(build_dir).is_dir():
        raise EagleExportError(f"{build_dir} is not a directory", "pass a build directory made by `eagle-export build`")
    return validate_build_dir(build_dir, on_check=on_check, exact=exact)
