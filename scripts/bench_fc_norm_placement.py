"""Where should EAGLE-3.1's gain-free aux normalization run after fold_fc_norm: drafter or target?

Builds a random target of the sample's shape (SmolLM2-135M: 30 layers, hidden 576, 9/3 heads,
vocab 49152, tied) and a matching random EAGLE-3.1 drafter (aux layers 2, 15, 27) with
non-trivial gains, in three forms:
  unfolded   fc(cat(g_i * n(a_i)))            the checkpoint as trained
  drafter    fc'(cat(n(a_i)))                  passes.fold_fc_norm (gains in fc', norms stay)
  target     fc'(aux), target emits n(a_i)     passes.fold_fc_norm_into_target
and measures, single-threaded, median of many interleaved runs:
  - the drafter's step 0 (fuse_aux) over W rows, in torch and in ONNX Runtime;
  - the target's extra cost for emitting normalized aux states (the three rms_normalize calls on
    its aux outputs, torch and ONNX Runtime; plus the whole target forward, torch);
  - the numerical difference of each form from the unfolded one (drafter step-0 state and logits
    fed by the target's aux states), fp32 and bf16, as max|a-b| / max|a|.

Run: python scripts/bench_fc_norm_placement.py [--runs 300]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import onnx
import torch
from torch import nn

from eagle_export.export.export import export_target as export_target_graph
from eagle_export.models import contract as C
from eagle_export.models.config import DrafterConfig, TargetConfig
from eagle_export.models.drafter import Drafter
from eagle_export.models.layers import rms_normalize
from eagle_export.models.target import Target
from eagle_export.passes.eagle_models import EagleModels
from eagle_export.passes.fold_norms import FoldFcNorm, FoldFcNormIntoTarget
from eagle_export.runtime.backends import ort_session

AUX = (2, 15, 27)
TARGET = dict(architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
              num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, rms_norm_eps=1e-5,
              rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192)
DRAFTER = dict(architectures=["LlamaForCausalLMEagle3"], hidden_size=576, intermediate_size=1536,
               num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, draft_vocab_size=8192,
               target_hidden_size=576, rms_norm_eps=1e-5, rope_theta=100000.0, fc_norm=True, norm_output=True,
               eagle_config={"eagle_aux_hidden_state_layer_ids": list(AUX)})


def build_forms() -> dict[str, EagleModels]:
    torch.manual_seed(0)
    target = Target(TargetConfig.from_hf(TARGET), AUX).eval()
    drafter = Drafter(DrafterConfig.from_hf(DRAFTER)).eval()
    with torch.no_grad():
        for model in (target, drafter):
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.3 * torch.randn_like(p))
                elif p.dim() == 2:
                    p.normal_(0, 0.02 if "embed" in name else p.shape[1] ** -0.5)
    drafter.share_embeddings(target.embed_tokens)
    unfolded = EagleModels(target, drafter)
    return {"unfolded": unfolded,
            "drafter": FoldFcNorm()(copy.deepcopy(unfolded)).model,
            "target": FoldFcNormIntoTarget()(copy.deepcopy(unfolded)).model}


def interleaved_medians(fns: dict, runs: int) -> dict[str, float]:
    """Median seconds per call; the candidates take turns, in a rotating order, so load drift and
    position in the round hit them alike."""
    times = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(5):
            fn()
    keys = list(fns)
    for run in range(runs):
        for k in keys[run % len(keys):] + keys[:run % len(keys)]:
            fn = fns[k]
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


class AuxNorm(nn.Module):
    """What the target placement adds to the target in torch eager: each aux chunk normalized."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.width, self.eps = width, eps

    def forward(self, aux):
        return torch.cat([rms_normalize(a, self.eps) for a in aux.split(self.width, dim=-1)], dim=-1)


class FuseAux(nn.Module):
    def __init__(self, drafter: Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, aux):
        return self.drafter.fuse_aux(aux)


def export_fuse_aux(drafter: Drafter, example: torch.Tensor, path: Path):
    torch.onnx.export(FuseAux(drafter), (example,), str(path), dynamo=False, opset_version=17,
                      input_names=["aux"], output_names=["out"], dynamic_axes={"aux": {0: "b", 1: "t"}})
    return ort_session(path, threads=1)


def export_target(target: Target, path: Path) -> onnx.ModelProto:
    """The real target graph, through the project's export (ONNX clean-up pipeline included)."""
    export_target_graph(target, path, return_logits=False)
    return onnx.load(str(path))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / a.float().abs().max())


@torch.no_grad()
def numerics(forms: dict[str, EagleModels], dtype: torch.dtype) -> dict[str, dict[str, float]]:
    forms = {k: EagleModels(*copy.deepcopy((m.target, m.drafter))) for k, m in forms.items()}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 49152, (2, 16), generator=g)
    positions = torch.arange(16).expand(2, -1)
    out = {}
    for name, m in forms.items():
        m.target.to(dtype), m.drafter.to(dtype)
        k, v = m.target.empty_cache(2, 0)
        _, aux, _, _ = m.target(ids, positions, k, v, torch.zeros(2, dtype=torch.long))
        hidden = m.drafter.fuse_aux(aux)
        dk, dv = m.drafter.empty_cache(2, 0)
        logits, _, _, _ = m.drafter(ids, hidden, positions, dk, dv, torch.zeros(2, dtype=torch.long))
        out[name] = {"step0_state": hidden, "draft_logits": logits}
    return {name: {key: rel(out["unfolded"][key], value) for key, value in outs.items()}
            for name, outs in out.items() if name != "unfolded"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    forms = build_forms()
    width = 576
    print(f"# fc_norm placement, sample-sized pair, 1 thread, median of {args.runs} interleaved runs")
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        tmp = Path(tmp)
        for rows in (5, 64):  # a verify round at depth 4 (K+1 rows), a prefill chunk
            aux = torch.randn(1, rows, len(AUX) * width)
            torch_fns = {f"fuse_aux[{k}]": (lambda d=m.drafter: d.fuse_aux(aux)) for k, m in forms.items()}
            torch_fns["target_aux_norm_eager[+]"] = lambda: AuxNorm(width, 1e-5)(aux)
            sessions = {f"fuse_aux[{k}]": export_fuse_aux(m.drafter, aux, tmp / f"fuse_{k}_{rows}.onnx")
                        for k, m in forms.items()}
            feed = {"aux": aux.numpy()}
            ort_fns = {k: (lambda s=s: s.run(None, feed)) for k, s in sessions.items()}
            print(f"\nrows={rows}  torch (us): " + "  ".join(
                f"{k} {v * 1e6:.1f}" for k, v in interleaved_medians(torch_fns, args.runs).items()))
            print(f"rows={rows}  onnxruntime (us): " + "  ".join(
                f"{k} {v * 1e6:.1f}" for k, v in interleaved_medians(ort_fns, args.runs).items()))
        # The whole target graph as exported: as is (drafter placement) vs emitting normalized aux.
        targets = {"as is": forms["drafter"].target, "normed aux": forms["target"].target}
        graphs = {k: export_target(t, tmp / f"target_{k.replace(' ', '_')}.onnx") for k, t in targets.items()}
        ops = {k: Counter(n.op_type for n in g.graph.node) for k, g in graphs.items()}
        print(f"\ntarget graph nodes: as is {sum(ops['as is'].values())}, normed aux {sum(ops['normed aux'].values())}; "
              f"ops added {dict(ops['normed aux'] - ops['as is'])}, removed {dict(ops['as is'] - ops['normed aux'])}")
        ids, pos = torch.randint(0, 49152, (1, 5)), torch.arange(128, 133)[None]
        k, v = targets["as is"].empty_cache(1, 128)
        lens = torch.tensor([128])
        feed = dict(zip(C.target_graph(targets["as is"].config, len(AUX), False).input_names,
                        (ids.numpy(), pos.numpy(), k.numpy(), v.numpy(), lens.numpy())))
        target_sessions = {k: ort_session(tmp / f"target_{k.replace(' ', '_')}.onnx", threads=1) for k in targets}
        runs = max(20, args.runs // 10)
        whole = interleaved_medians({f"ort[{name}]": (lambda s=s: s.run(None, feed))
                                     for name, s in target_sessions.items()}
                                    | {f"torch[{name}]": (lambda t=t: t(ids, pos, k, v, lens))
                                       for name, t in targets.items()}, runs)
        print(f"target forward, 5 tokens over 128 cached, median of {runs} (ms): "
              + "  ".join(f"{k} {v * 1e3:.2f}" for k, v in whole.items()))
    for dtype in (torch.float32, torch.bfloat16):
        print(f"\nnumerics vs unfolded, {dtype} (max|a-b|/max|a|):")
        for name, errs in numerics(forms, dtype).items():
            print(f"  {name:8} " + "  ".join(f"{k} {v:.2e}" for k, v in errs.items()))


if __name__ == "__main__":
    main()
