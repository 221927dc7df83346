"""Post-training quantization with NVIDIA ModelOpt: FP8 and NVFP4, weights and activations or weights only.

`quantize(model, precision, calib_batches)` inserts ModelOpt quantizers (`mtq.quantize`) into every
nn.Linear except the excluded ones (lm_head and the drafter's fc stay in high precision by default)
and calibrates them with max calibration on real prompts. The drafter calibrates on the target's aux
states for the same prompts, step 0 plus a few feedback steps, as it runs in decoding.

What runs where:
- FP8 (E4M3, per-tensor scales for weights and activations): calibration and ModelOpt's fake
  quantization both run on CPU.
- NVFP4 (E2M1 in blocks of 16 along the input axis, FP8 block scales, an fp32 global scale):
  ModelOpt's calibration runs on CPU, but its fake-quantization kernel asserts a CUDA tensor. On
  CPU the calibrated Linears are therefore converted to `nvfp4.NVFP4Linear` (`pack_nvfp4`), with
  NVFP4QTensor's numerics. `fake_quant="modelopt"` keeps ModelOpt's own quantizers instead, which
  needs CUDA.
- FP8 KV cache: not offered. ModelOpt quantizes the KV cache through `*[kv]_bmm_quantizer`s that
  exist only on the attention classes it patches (Hugging Face and Megatron ones), not on our
  Attention; and the graph contract passes the cache in the model dtype, so an FP8 cache would
  be a contract change (FP8 cache inputs plus a TensorRT attention that reads them).
"""

from __future__ import annotations

import copy
import warnings
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..data.prompts import ChatTemplate, chat_prompts
from ..errors import EagleExportError
from ..export.loader import load_pair
from ..models.drafter import Drafter
from ..models.nvfp4 import pack_nvfp4
from ..models.target import Target
from ..progress import track
from ..speculation.eager import draft_chain, replay_greedy
from ..speculation.stats import mean_accepted_length

QUANT_PRESETS = ("fp8", "fp8_weight_only", "nvfp4", "nvfp4_weight_only")  # ModelOpt presets `quantize` applies
DEFAULT_EXCLUDE = ("lm_head", "fc")
DRAFTER_CALIBRATION_STEPS = 3  # feedback steps after step 0: the states the drafter sees in decoding


def _mtq():
    with warnings.catch_warnings():  # modelopt warns about untested transformers versions at import
        warnings.simplefilter("ignore")
        import modelopt.torch.quantization as mtq
    return mtq


def quant_config(precision: str, exclude: Iterable[str] = DEFAULT_EXCLUDE) -> dict:
    """ModelOpt's preset for `precision`, with every module named in `exclude` left unquantized.

    A name matches the module with that exact name anywhere in the tree (`fc` is `fc` or `x.fc`,
    never `fc_norm`): quantizer names are `<module path>.weight_quantizer` / `.input_quantizer`.
    """
    mtq = _mtq()
    if precision not in QUANT_PRESETS:
        raise EagleExportError(f"unknown precision {precision!r}", f"use one of {', '.join(QUANT_PRESETS)}")
    preset = {"fp8": mtq.FP8_DEFAULT_CFG, "fp8_weight_only": mtq.FP8_DEFAULT_CFG,
              "nvfp4": mtq.NVFP4_DEFAULT_CFG, "nvfp4_weight_only": mtq.W4A16_NVFP4_CFG}[precision]
    cfg = copy.deepcopy(preset)
    if precision == "fp8_weight_only":
        cfg["quant_cfg"].append({"quantizer_name": "*input_quantizer", "enable": False})
    for name in exclude:
        cfg["quant_cfg"] += [{"quantizer_name": f"{name}.*", "enable": False},
                             {"quantizer_name": f"*.{name}.*", "enable": False}]
    return cfg


def calibration_step(model: nn.Module, batch: tuple) -> None:
    """Run one calibration batch the way the model runs in decoding.

    Target batches are its forward arguments. Drafter batches are (input_ids, aux): step 0 on
    fuse_aux(aux), then DRAFTER_CALIBRATION_STEPS feedback steps on its own greedy drafts."""
    if isinstance(model, Drafter):
        draft_chain(model, *batch, depth=DRAFTER_CALIBRATION_STEPS + 1)
    else:
        model(*batch)


def quantize(model: nn.Module, precision: str, calib_batches: Iterable[tuple],
             exclude: Iterable[str] = DEFAULT_EXCLUDE, fake_quant: str = "auto") -> nn.Module:
    """Quantize `model` (a Target or a Drafter) in place with ModelOpt and return it.

    calib_batches: from `target_calibration_batches` / `drafter_calibration_batches`.
    fake_quant (NVFP4 only): "modelopt" keeps ModelOpt's quantizers (needs CUDA), "packed" converts
    to NVFP4Linear (CPU), "auto" picks "modelopt" when the model is on a CUDA device; "export" keeps
    ModelOpt's calibrated quantizers on any device, for ModelOpt's exporter only (on CPU an NVFP4
    model in this state cannot run)."""
    if fake_quant not in ("auto", "modelopt", "packed", "export"):
        raise EagleExportError(f"unknown fake_quant {fake_quant!r}", "use auto, modelopt, packed or export")
    mtq = _mtq()
    cfg = quant_config(precision, exclude)
    on_cuda = any(p.is_cuda for p in model.parameters())
    nvfp4 = precision.startswith("nvfp4")
    if nvfp4 and fake_quant == "modelopt" and not on_cuda:
        raise EagleExportError(
            "ModelOpt's NVFP4 fake quantization needs CUDA (its dynamic block quantizer asserts a CUDA tensor), "
            "and this model is on the CPU" + ("" if torch.cuda.is_available() else " of a machine without a GPU"),
            "use fake_quant='packed' (the default on CPU): ModelOpt calibrates on CPU and the weights are "
            "packed with NVFP4QTensor, with the same numerics; or move the model to a CUDA device")
    batches = list(calib_batches)
    if not batches:
        raise EagleExportError("no calibration batches", "pass at least one prompt to calibrate on")

    def forward_loop(m):
        for batch in track(batches, "calibrating"):
            calibration_step(m, batch)

    # ModelOpt converts modules in place (it swaps their class), so a drafter's shared embedding
    # table is hidden from it: it belongs to the target, which is quantized on its own.
    shared = model.embed_tokens if isinstance(model, Drafter) and not model.owns_embeddings else None
    if shared is not None:
        model.embed_tokens = _Unregistered(shared)
    try:
        with torch.no_grad():
            mtq.quantize(model, cfg, forward_loop)
    finally:
        if shared is not None:
            model.embed_tokens = shared
    check_row_local_activations(model)
    if nvfp4 and (fake_quant == "packed" or (fake_quant == "auto" and not on_cuda)):
        pack_nvfp4(model)
    return model


def check_row_local_activations(model: nn.Module) -> None:
    """Refuse an activation quantizer whose scale is computed at run time over the whole tensor
    (dynamic per-tensor): each token's result would then depend on the other tokens of its call, and
    speculative decoding could match neither one-token nor verify-width greedy decoding (the lossless
    contract's T1). ModelOpt does so for an enabled quantizer calibration left without an amax; its
    dynamic block quantizers (NVFP4's 16 elements along the input axis) are per row, and allowed."""
    for name, module in model.named_modules():
        if not name.endswith("input_quantizer") or not getattr(module, "is_enabled", False):
            continue
        blocks = getattr(module, "block_sizes", None) or {}
        if blocks.get("type") == "dynamic" and set(k for k in blocks if isinstance(k, int)) == {-1}:
            continue  # a scale per block of one row
        if getattr(module, "amax", None) is None:
            raise EagleExportError(
                f"the activation quantizer {name} has no calibrated scale, so ModelOpt computes it at run time "
                "over the whole tensor (dynamic per-tensor): every token's result would depend on the other "
                "tokens of its call, and speculative decoding could not be verified",
                "calibrate static activation scales on prompts that reach this module (calibration.num_samples), "
                "exclude it from quantization, or quantize it per token or per block of one row")


class _Unregistered(nn.Module):
    """Calls a module without making it a submodule (invisible to named_modules)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.__dict__["module"] = module

    def forward(self, *args):
        return self.module(*args)


# ---------------------------------------------------------------- calibration data

def random_prompts(vocab_size: int, count: int = 4, length: int = 24, seed: int = 0) -> list[list[int]]:
    """Random ids, for tiny random models in tests (their tokenizer would mean nothing)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (count, length), generator=gen).tolist()


def target_calibration_batches(target: Target, prompts: list[list[int]]) -> list[tuple]:
    """One prefill per prompt (batch 1, any lengths): the target's forward arguments."""
    batches = []
    for ids in prompts:
        k, v = target.empty_cache(1, 0)
        t = torch.tensor([ids])
        batches.append((t, torch.arange(len(ids))[None], k, v, torch.zeros(1, dtype=torch.long)))
    return batches


@torch.no_grad()
def drafter_calibration_batches(target: Target, prompts: list[list[int]]) -> list[tuple]:
    """(ids t_1..t_n, aux a_0..a_{n-1}) per prompt, the EAGLE-3 pairing (at positions 0..n-1), with
    t_n the target's own greedy next token: the drafter's real step-0 input on these prompts."""
    batches = []
    for ids, args in track(zip(prompts, target_calibration_batches(target, prompts)), "target aux states", len(prompts)):
        logits, aux, _, _ = target(*args)
        batches.append((torch.tensor([ids[1:] + [int(logits[0, -1].argmax())]]), aux))
    return batches


# ---------------------------------------------------------------- metrics

def _kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean KL(reference || quantized) of the next-token distributions, in nats."""
    p = F.log_softmax(ref_logits.float(), -1)
    q = F.log_softmax(logits.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@torch.no_grad()
def target_metrics(reference: Target, quantized: Target, prompts: list[list[int]]) -> dict:
    """Top-1 agreement and KL of the quantized target's next-token distribution over every prompt position."""
    ref, quant = [], []
    for args in track(target_calibration_batches(reference, prompts), "target agreement"):
        ref.append(reference(*args)[0][0])
        quant.append(quantized(*args)[0][0])
    ref, quant = torch.cat(ref), torch.cat(quant)
    return {"top1_agreement": float((ref.argmax(-1) == quant.argmax(-1)).float().mean()),
            "kl": _kl(ref, quant), "positions": ref.shape[0]}


@torch.no_grad()
def greedy_runs(target: Target, prompts: list[list[int]], new_tokens: int, depth: int) -> list[tuple]:
    """Per prompt: (the prompt then the target's greedy continuation of new_tokens + depth tokens, not
    cut at EOS; the target's aux states of all but its last token, one teacher-forced pass). One run
    serves the continuation checks and tau at depth `depth` (`replay_greedy`), so each target
    decodes each prompt once."""
    runs = []
    for ids in track(prompts, "greedy continuations"):
        sequence = list(ids) + target.generate_greedy(ids, new_tokens + depth)
        runs.append((sequence, target(*target_calibration_batches(target, [sequence[:-1]])[0])[1]))
    return runs


def _continuation(sequence: list[int], prompt_len: int, new_tokens: int, eos_ids) -> list[int]:
    """The first `new_tokens` tokens after the prompt, up to the first EOS included: what
    `generate_greedy(prompt, new_tokens, eos_ids)` returns (greedy decoding does not look ahead)."""
    out = sequence[prompt_len:prompt_len + new_tokens]
    end = next((i + 1 for i, t in enumerate(out) if t in eos_ids), len(out))
    return out[:end]


@torch.no_grad()
def greedy_continuation_agreement(reference: Target, quantized: Target, prompts: list[list[int]],
                                  new_tokens: int = 64, runs: tuple[list, list] | None = None) -> dict:
    """How closely the quantized target follows the reference's greedy continuations.

    `greedy_agreement`: the reference generates up to `new_tokens` greedy tokens per prompt (stopping
    at EOS); the quantized target reads prompt + continuation and its argmax is compared with the
    reference's token at each continuation position (teacher forced, so one early flip does not
    condemn the rest). `free_running_prefix`: the quantized target's own greedy continuation, the
    mean fraction of it that matches the reference's before the first difference. `runs`: the two
    targets' `greedy_runs` on these prompts (at least `new_tokens` long), decoded here when None."""
    eos = (reference.config.eos_token_id,)
    if runs is None:
        runs = tuple(greedy_runs(model, prompts, new_tokens, 0) for model in (reference, quantized))
    agree = total = 0
    prefixes = []
    for ids, (reference_run, _), (quantized_run, _) in zip(prompts, *runs):
        expected = _continuation(reference_run, len(ids), new_tokens, eos)
        args = target_calibration_batches(quantized, [ids + expected[:-1]])[0]
        predicted = quantized(*args)[0][0, len(ids) - 1:].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(predicted, expected))
        total += len(expected)
        own = _continuation(quantized_run, len(ids), len(expected), eos)
        same = next((i for i, (a, b) in enumerate(zip(own, expected)) if a != b), min(len(own), len(expected)))
        prefixes.append(same / len(expected))
    return {"greedy_agreement": agree / total, "free_running_prefix": sum(prefixes) / len(prefixes),
            "continuation_tokens": total, "prompts": len(prompts), "new_tokens": new_tokens}


@torch.no_grad()
def speculative_tau(target: Target, drafter: Drafter, prompts: list[list[int]], new_tokens: int, depth: int,
                    runs: list[tuple] | None = None) -> float:
    """Mean tokens per round of the greedy loop (chain depth `depth`, `new_tokens` per prompt, EOS not
    stopping it) over `prompts`, replayed from the target's greedy runs (`greedy_runs`, decoded here
    when None): greedy output is the target's whatever the drafter proposes, so each round's accepted
    count is the number of leading drafts of the drafter's chain after the round's prefix that the
    target's continuation holds (`reference.replay_greedy`: the loop's rounds, without a verify call
    per round)."""
    runs = runs if runs is not None else greedy_runs(target, prompts, new_tokens, depth)
    return mean_accepted_length([m for ids, (sequence, aux) in zip(prompts, runs)
                                 for m in replay_greedy(drafter, sequence, aux, len(ids), new_tokens,
                                                        [depth])[depth].accepted])


@torch.no_grad()
def drafter_metrics(reference: Drafter, quantized: Drafter, target: Target, prompts: list[list[int]]) -> dict:
    """Draft agreement on the (unquantized) target's aux states: step 0 at every position (top-1
    agreement and KL of the draft distribution), then each drafter's own feedback chain from the
    last position (fraction of the DRAFTER_CALIBRATION_STEPS drafts fed back that agree)."""
    ref_all, quant_all, chain_agree, chain_total = [], [], 0, 0
    for ids, aux in drafter_calibration_batches(target, prompts):
        ref, quant = (draft_chain(model, ids, aux, DRAFTER_CALIBRATION_STEPS + 1) for model in (reference, quantized))
        ref_all.append(ref.step0_logits[0])
        quant_all.append(quant.step0_logits[0])
        fed_back = slice(0, DRAFTER_CALIBRATION_STEPS)
        chain_agree += int((ref.drafts[0, fed_back] == quant.drafts[0, fed_back]).sum())
        chain_total += DRAFTER_CALIBRATION_STEPS
    ref, quant = torch.cat(ref_all), torch.cat(quant_all)
    return {"top1_agreement": float((ref.argmax(-1) == quant.argmax(-1)).float().mean()),
            "kl": _kl(ref, quant), "chain_agreement": chain_agree / chain_total, "positions": ref.shape[0]}


# ---------------------------------------------------------------- the whole stage

def weights_folded(model: nn.Module) -> nn.Module:
    """A copy of a quantized model for measuring it: ModelOpt's weight fake quantization applied once
    (`mtq.fold_weight`: each weight replaced by its quantize-dequantize, its weight quantizer
    disabled). The outputs are the same bit for bit; the fake-quantized model re-quantizes every
    weight at every call instead, which on CPU made a one-token step about 14x slower."""
    folded = copy.deepcopy(model)
    _mtq().fold_weight(folded)
    return folded


def quantize_pair(target: Target, drafter: Drafter | None, target_precision: str | None,
                  drafter_precision: str | None, calibration: list[list[int]], metric_prompts: list[list[int]],
                  continuation_prompts: list[list[int]] = (), tau_prompts: list[list[int]] = (),
                  exclude: Iterable[str] = DEFAULT_EXCLUDE, depth: int = 4, max_new_tokens: int = 64,
                  progress=None) -> tuple[Target, Drafter | None, dict]:
    """Quantize a target and its drafter (each to its precision; None leaves it as it is) and
    measure the result against the pair as given, which stays untouched as the reference.

    The drafter calibrates on the unquantized target's aux states for the calibration prompts.
    Metrics, on prompts the calibration did not see: next-token agreement and KL (`metric_prompts`),
    greedy continuations of `max_new_tokens` (`continuation_prompts`), draft agreement, and tau of
    the quantized pair against the reference pair (`tau_prompts`, greedy, depth `depth`); empty
    prompt lists skip their measurement. Returns (quantized target, quantized drafter, report)."""
    progress = progress or (lambda message: None)
    if not calibration:
        raise EagleExportError("the calibration set gave no prompts", "calibrate on more prompts")
    report = {}
    qtarget, qdrafter = target, drafter
    measured_target, measured_drafter = target, drafter  # quantized ones: their weights folded (same outputs)
    runs = {}  # a target's greedy runs on a prompt list: decoded once for the continuations and every tau

    def runs_of(model, prompts):
        key = model, tuple(map(tuple, prompts))
        if key not in runs:
            runs[key] = greedy_runs(model, prompts, max_new_tokens, depth)
        return runs[key]

    if target_precision is not None:
        progress(f"quantizing the target to {target_precision} on {len(calibration)} prompts")
        qtarget = quantize(copy.deepcopy(target), target_precision, target_calibration_batches(target, calibration),
                           exclude)
        measured_target = weights_folded(qtarget)
        report["target"] = {"precision": target_precision,
                            **target_metrics(target, measured_target, metric_prompts)}
        if continuation_prompts:
            progress(f"greedy continuations of {max_new_tokens} tokens on {len(continuation_prompts)} prompts")
            report["target"]["continuations"] = greedy_continuation_agreement(
                target, measured_target, continuation_prompts, max_new_tokens,
                (runs_of(target, continuation_prompts), runs_of(measured_target, continuation_prompts)))
    if drafter is not None and drafter_precision is not None:
        progress(f"quantizing the drafter to {drafter_precision} on the target's aux states")
        qdrafter = copy.deepcopy(drafter)
        qdrafter.share_embeddings(qtarget.embed_tokens)
        quantize(qdrafter, drafter_precision, drafter_calibration_batches(target, calibration), exclude)
        measured_drafter = weights_folded(qdrafter)
        report["drafter"] = {"precision": drafter_precision,
                             **drafter_metrics(drafter, measured_drafter, target, metric_prompts)}
    if drafter is not None and tau_prompts:  # the pair as quantized (an unquantized model stays the reference one)
        progress(f"measuring tau on {len(tau_prompts)} prompts")

        def tau(model, draft):
            return speculative_tau(model, draft, tau_prompts, max_new_tokens, depth, runs_of(model, tau_prompts))
        report["tau_reference"] = tau(target, drafter)
        report["tau_quantized"] = tau(measured_target, measured_drafter)
        report["tau_ratio"] = report["tau_quantized"] / report["tau_reference"]
        if measured_target is not target and measured_drafter is not drafter:  # the drafter against its unquantized self
            report["tau_unquantized_drafter"] = tau(measured_target, drafter)
            report["tau_drafter_ratio"] = report["tau_quantized"] / report["tau_unquantized_drafter"]
    return qtarget, qdrafter, report


def quantize_models(target_dir, drafter_dir, precision: str, depth: int = 4,
                    exclude: Iterable[str] = DEFAULT_EXCLUDE, calib_prompts: int = 16, eval_prompts: int = 8,
                    tau_prompts: int = 0, continuation_prompts: int = 0, max_new_tokens: int = 64,
                    progress=None) -> tuple[dict, Target, Drafter | None]:
    """The `quantize` command: load a target (and optionally its drafter) as `build` does, model passes
    included (`load_pair`: q/k/v and gate/up fused, norm gains folded), and `quantize_pair` them,
    calibrated on ShareGPT conversations and measured on MT-bench turn 1 (both chat-templated,
    cut to 384 tokens): metrics on `eval_prompts` of them, continuations and tau on the first
    `continuation_prompts` / `tau_prompts`. Returns (report, quantized target, quantized drafter)."""
    # The target in its own dtype, the drafter in the target's (it reads the target's aux states).
    target, drafter = load_pair(target_dir, drafter_dir or None, None)
    template = ChatTemplate(target_dir)
    calib = list(chat_prompts(template, "sharegpt", calib_prompts, max_tokens=384))
    evals = list(chat_prompts(template, "mt-bench", max(eval_prompts, tau_prompts, continuation_prompts),
                              max_tokens=384))
    report = {"precision": precision, "exclude": list(exclude), "calibration": f"sharegpt x{len(calib)}",
              "evaluation": f"mt-bench x{eval_prompts}"}
    qtarget, qdrafter, measured = quantize_pair(
        target, drafter, precision, precision, calib, evals[:eval_prompts], evals[:continuation_prompts],
        evals[:tau_prompts], exclude, depth, max_new_tokens, progress)
    return {**report, **measured}, qtarget, qdrafter
