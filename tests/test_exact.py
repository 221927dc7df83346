"""Exact mode (runtime/exact.py): the torch backend's models bound to the width-invariant kernels.

On a CPU through Triton's interpreter (conftest): a position's logits and K/V have the same bits as
row 0 of a one-token step and as row j of a verify call, in fp32 and bf16, inside a batch too; a planted KV
split by count fails that check; the norms and the MLP's activation ride in the linear kernels (counted);
`--exact` where it cannot hold is one line before any model loads; the runtime imports no Triton unless
exact mode is asked for.
"""

import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from eagle_export import kernels
from eagle_export.cli import main
from eagle_export.errors import EagleExportError
from eagle_export.export.unrolled import TargetGraph, UnrolledDrafter
from eagle_export.models.layers import Attention, RowLinear, width_invariant
from eagle_export.runtime import exact
from eagle_export.tools import gpu_kit

pytestmark = pytest.mark.usefixtures("no_grad")
triton = pytest.importorskip("triton", reason="exact mode's tests need triton (pip install '.[test]')")


def tiny_graph(dtype=torch.bfloat16):
    target, drafter = gpu_kit.random_pair("tiny", "cpu", dtype, layers=2)
    return TargetGraph(target, True), target


def decode(graph, target, prompts, widths):
    """Each prompt but its last sum(widths) tokens prefilled alone, then the rest decoded in calls of
    `widths` tokens, batched over the prompts (ragged: each at its own length) -> per prompt, the
    logits and new K of each decoded position."""
    batch, tail = len(prompts), sum(widths)
    lens = [len(p) - tail for p in prompts]
    k, v = target.empty_cache(batch, 64)
    logits, keys = [[] for _ in prompts], [[] for _ in prompts]

    def call(ids, start, b=slice(None)):  # ids [B,T] at positions start[b]..
        t = ids.shape[1]
        kk, vv = k[:, b], v[:, b]
        positions = torch.tensor(start)[:, None] + torch.arange(t)[None]
        out = graph(ids, positions, kk, vv, torch.tensor(start), torch.ones(len(start), t, t, dtype=torch.bool).tril())
        for i, s in enumerate(start):
            kk[:, i, :, s:s + t], vv[:, i, :, s:s + t] = out[3][:, i], out[4][:, i]
        return out

    for b, (p, n) in enumerate(zip(prompts, lens)):
        call(torch.tensor([p[:n]]), [0], slice(b, b + 1))
    done = 0
    for w in widths:
        start = [n + done for n in lens]
        out = call(torch.tensor([p[s:s + w] for p, s in zip(prompts, start)]), start)
        for b in range(batch):
            logits[b] += list(out[1][b])
            keys[b] += list(out[3][:, b].transpose(0, 2))
        done += w
    return logits, keys


def mismatches(graph, target, batched: bool = True) -> list[str]:
    """Positions 14..19 decoded one token at a time at batch 1 against the same positions as rows of
    verify calls of width 4 and 2 and, `batched`, inside a ragged batch of 2 (widths 2 and 4): the
    kinds whose logits or K differ in any bit."""
    gen = torch.Generator().manual_seed(0)
    prompt, other = (torch.randint(3, 500, (n,), generator=gen).tolist() for n in (20, 15))
    plain = decode(graph, target, [prompt], [1] * 6)
    kinds = [("verify 4+2", [prompt], [4, 2])] + ([("batch of 2, verify 2+4", [other, prompt], [2, 4])] if batched else [])
    found = []
    for name, prompts, widths in kinds:
        logits, keys = decode(graph, target, prompts, widths)
        if not (all(map(torch.equal, logits[-1], plain[0][0])) and all(map(torch.equal, keys[-1], plain[1][0]))):
            found.append(name)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_bound_target_gives_a_position_the_same_bits_in_every_call(dtype):
    graph, target = tiny_graph(dtype)
    exact.bind(graph)
    attn = target.layers[0].self_attn
    assert type(target.lm_head) is exact.ExactLinear and attn.core is exact.attention_core
    assert type(attn) is exact.ExactAttention
    assert mismatches(graph, target) == []


@pytest.mark.slow
def test_a_kv_split_by_count_bound_in_its_place_fails_the_check(monkeypatch):
    """In fp32, where a reduction order shows in the logits' bits (bf16 rounds most such differences
    away, which is why the kernels' own planted tests run in fp32 too)."""
    graph, target = tiny_graph(torch.float32)
    exact.bind(graph)
    ops = kernels.ops()
    real = ops.attention
    # flash-decoding's occupancy rule: more splits of the cache view for a one-token call
    monkeypatch.setattr(ops, "attention", lambda q, kc, vc, kn, vn, mask, keys=None: real(
        q, kc, vc, kn, vn, mask, split_size=triton.cdiv(kc.shape[2], 8 if q.shape[2] == 1 else 2), keys=keys))
    assert mismatches(graph, target, batched=False) == ["verify 4+2"]


def test_bound_outputs_match_torch_and_unbind_restores_it(monkeypatch):
    """fp32: the kernels' logits within 1e-4 of torch's (relative to the largest); unbound, torch's own
    bits. Bound, each layer's RoPE is the fused kernel, once a call; unbound, never."""
    graph, target = tiny_graph(torch.float32)
    ops, ropes = kernels.ops(), []
    real_rope = ops.rope
    monkeypatch.setattr(ops, "rope", lambda *a: ropes.append(a[0].shape) or real_rope(*a))
    ids = torch.randint(3, 500, (2, 6))
    args = (ids, torch.arange(6)[None].expand(2, -1), *target.empty_cache(2, 0), torch.zeros(2, dtype=torch.int64),
            torch.ones(2, 6, 6, dtype=torch.bool).tril())
    before = graph(*args)
    exact.bind(graph)
    bound = graph(*args)
    assert ropes == [(2, target.config.num_heads, 6, target.config.head_dim)] * len(target.layers)
    assert torch.equal(bound[0], before[0])
    for a, b in zip(bound[1:], before[1:]):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()
    exact.unbind(graph)
    assert all(torch.equal(a, b) for a, b in zip(graph(*args), before))
    assert type(target.lm_head) is torch.nn.Linear and "core" not in vars(target.layers[0].self_attn)
    assert len(ropes) == len(target.layers)


@pytest.mark.slow
def test_qwen3s_qk_norm_rides_in_the_rope_launch(monkeypatch):
    """A Qwen3 target bound: its qk-norm in the RoPE kernel, and (gains unfolded, q/k/v and gate/up
    unfused: each projection normalizes its rows itself) its other norms in the linear layers: no RMSNorm
    launch at all; the logits within 1e-4 of torch's (fp32, relative to the largest), and a position's
    bits the same in every call."""
    from tiny_models import tiny_target_config

    from eagle_export.models.config import TargetConfig
    from eagle_export.models.target import Target

    torch.manual_seed(0)
    target = Target(TargetConfig.from_hf(tiny_target_config("qwen3", num_hidden_layers=2, vocab_size=512), "tiny qwen3"))
    for layer in target.layers:  # gains away from 1, so a gain applied twice or not at all shows
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            norm.weight.data.uniform_(0.5, 1.5)
    graph = TargetGraph(target, True)
    ids = torch.randint(3, 300, (1, 5))
    args = (ids, torch.arange(5)[None], *target.empty_cache(1, 0), torch.zeros(1, dtype=torch.int64),
            torch.ones(1, 5, 5, dtype=torch.bool).tril())
    before = graph(*args)[1]
    ops, calls = kernels.ops(), []
    for name in ("rope", "rms_norm"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, real=real, name=name: calls.append((name, a[0].shape[-1], len(a)))
                            or real(*a))
    exact.bind(graph)
    bound = graph(*args)[1]
    assert (bound - before).abs().max() <= 1e-4 * before.abs().max()
    assert ("rope", 16, 5) in calls and not any(name == "rms_norm" for name, _, _ in calls)
    assert mismatches(graph, target, batched=False) == []


def test_bind_gives_every_attention_the_fused_rope_drafters_too_and_unbind_takes_it_back():
    target, drafter = gpu_kit.random_pair("tiny", "cpu", torch.float32, layers=2)
    graphs = TargetGraph(target, True), UnrolledDrafter(drafter, 2, False)
    attentions = [m for g in graphs for m in g.modules() if isinstance(m, Attention)]
    assert len(attentions) == len(target.layers) + 1  # the target's layers and the drafter's one
    exact.bind(*graphs)
    assert all(type(a) is exact.ExactAttention and a.core is exact.attention_core for a in attentions)
    exact.unbind(*graphs)
    assert all(type(a) is Attention and "core" not in vars(a) for a in attentions)


def test_unbind_restores_the_class_each_module_had():
    """A graph in the torch CPU backend's layout (RowLinear) comes back in it, not as nn.Linear."""
    graph, target = tiny_graph(torch.float32)
    width_invariant(graph)
    before = {name: type(m) for name, m in graph.named_modules()}
    exact.bind(graph)
    assert type(target.lm_head) is exact.ExactLinear
    exact.unbind(graph)
    assert {name: type(m) for name, m in graph.named_modules()} == before and RowLinear in before.values()


@pytest.mark.parametrize("kwargs, words", [
    (dict(device="cuda", dtypes={"bf16"}, backend="onnxruntime"), "onnxruntime backend runs its own kernels"),
    (dict(device="cuda", dtypes={"bf16"}, precisions={"nvfp4"}), "nvfp4 weights"),
    (dict(device="cuda", dtypes={torch.float64}), "dtype float64"),
    (dict(device="cuda", dtypes={"bf16"}, head_dim=512), "head_dim 512"),
    (dict(device="cuda", dtypes={"bf16"}, head_dim=63), "head_dim 63 is odd"),
])
def test_exact_is_refused_where_it_cannot_hold_in_one_line(kwargs, words):
    with pytest.raises(EagleExportError) as e:
        exact.check(**kwargs)
    assert words in e.value.problem and "\n" not in e.value.problem
    assert "tiered contract" in e.value.fix and "without --exact" in e.value.fix


@pytest.mark.parametrize("card, dtypes, words", [
    ((7, 5), {"bf16"}, "bfloat16 on a GPU of compute capability 7.5"), ((6, 1), {"fp16"}, "compute capability 6.1"),
    ((7, 5), {"fp16"}, None), ((9, 0), {"bf16"}, None)])
def test_a_card_too_old_for_the_kernels_is_refused_by_name(monkeypatch, card, dtypes, words):
    """A T4 (7.5) runs Triton's fp16 dot but not its bf16 one; a Pascal card (6.x) no Triton at all."""
    monkeypatch.setattr(kernels, "capability", lambda: card)
    found = exact.problems("cuda", dtypes)
    assert (words is None and not any("capability" in f for f in found)) or any(words in f for f in found), found


def test_without_the_interpreter_a_cpu_is_refused_before_any_model_is_made(tmp_path):
    """gpu-kit --exact on a CPU with the interpreter off: the one-line error, no report, no traceback."""
    code = ("import sys; from eagle_export.cli import main; sys.argv = ['eagle-export', 'gpu-kit', '--shapes', 'tiny', "
            "'--exact', '--plot', '']; main()")
    env = {**__import__("os").environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert "exact mode cannot hold here: the model runs on cpu" in run.stderr + run.stdout
    assert not (tmp_path / "gpu-kit.json").exists()


def test_the_runtime_imports_no_triton_unless_exact_mode_is_asked_for():
    code = ("import sys, eagle_export.runtime.runtime, eagle_export.builder.build_dir, eagle_export.cli; "
            "assert 'triton' not in sys.modules, 'triton imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_the_cli_commands_take_exact():
    for command in ("run", "bench", "validate", "gpu-kit"):
        assert "--exact" in CliRunner().invoke(main, [command, "--help"]).output, command


def test_a_layer_the_kernels_do_not_cover_is_refused_not_left_unbound():
    """An NVFP4 or ModelOpt layer keeps its own kernels: exact mode refuses the model, naming it."""
    class PackedLinear(torch.nn.Module):  # what models.nvfp4.NVFP4Linear looks like to the check
        def __init__(self):
            super().__init__()
            self.packed = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)

    target, drafter = gpu_kit.random_pair("tiny", "cpu", torch.float32, layers=2)
    exact.insist(exact.model_problems("cpu", target, drafter))  # the interpreter stands in for a GPU
    target.layers[1].mlp.down_proj = PackedLinear()
    with pytest.raises(EagleExportError, match="PackedLinear"):
        exact.insist(exact.model_problems("cpu", target, drafter))


def test_the_default_binds_the_kernels_on_a_gpu_wherever_they_hold(capsys):
    """exact=None (the torch backend's default): on CUDA the kernels wherever they hold, else torch's with
    one note naming why and the tiered contract; on a CPU the CPU layout, silently. True insists."""
    class PackedLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.packed = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)

    target, drafter = gpu_kit.random_pair("tiny", "cpu", torch.bfloat16, layers=2)
    assert exact.resolve(None, "cuda", target, drafter) is True  # (the interpreter stands in for the GPU)
    assert exact.resolve(None, "cpu", target, drafter) is False
    assert exact.resolve(False, "cuda", target, drafter) is False
    assert capsys.readouterr().err == ""
    target.layers[1].mlp.down_proj = PackedLinear()
    assert exact.resolve(None, "cuda", target, drafter) is False
    note = capsys.readouterr().err
    assert note.count("\n") == 1 and "exact mode off (PackedLinear" in note and "tiered contract" in note
    with pytest.raises(EagleExportError, match="PackedLinear"):
        exact.resolve(True, "cuda", target, drafter)


def test_only_a_call_wider_than_any_decoding_call_runs_torchs_gemms_and_attention(monkeypatch):
    """WIDEST rows a sequence (a verify call over the largest tree) through the kernels; a wider call,
    which only a prefill is, through cuBLAS-style F.linear and torch attention."""
    graph, target = tiny_graph(torch.float32)
    exact.bind(graph)
    from eagle_export.kernels import reference

    ops, calls = kernels.ops(), []
    for name in ("linear", "attention"):  # counted, and run by the torch references (the interpreter is slow)
        ref = getattr(reference, name)
        monkeypatch.setattr(ops, name, lambda *a, ref=ref, name=name, keys=None, **kw: calls.append(name) or ref(*a, **kw))
    for width, kernel_calls in ((exact.WIDEST, 2 * (4 + 1) + 1), (exact.WIDEST + 1, 0)):
        calls.clear()
        ids = torch.randint(3, 500, (1, width))
        graph(ids, torch.arange(width)[None], *target.empty_cache(1, 0), torch.zeros(1, dtype=torch.int64),
              torch.ones(1, width, width, dtype=torch.bool).tril())
        assert len(calls) == kernel_calls, (width, calls)


def test_the_norms_and_the_activation_ride_in_the_linear_kernels(monkeypatch):
    """Bound, a tiny Llama pair launches no RMSNorm or silu_mul of its own where a linear layer follows
    (fp32, the real kernels, counted): the target's input and post-attention norms in q/k/v's and
    gate/up's prologue, the final norm in lm_head's, silu(gate) * up in down's. The drafter keeps three
    RMSNorm launches a step, which cannot fuse: input_layernorm and hidden_norm (the attention reads their
    concatenation) and its final norm (its output is also fed back, and the root's row is picked after
    it). Target and drafter outputs within 1e-4 of torch's (relative to the largest), draft ids equal."""
    target, drafter = gpu_kit.random_pair("tiny", "cpu", torch.float32, layers=2)
    graphs = TargetGraph(target, True), UnrolledDrafter(drafter, 2, False)
    b, t, layers = 2, 3, len(target.layers)
    target_args = (torch.randint(3, 500, (b, t)), torch.arange(t)[None].expand(b, -1), *target.empty_cache(b, 0),
                   torch.zeros(b, dtype=torch.int64), torch.ones(b, t, t, dtype=torch.bool).tril())
    drafter_args = (torch.randint(3, 500, (b, t)), torch.randn(b, t, target.aux_width), torch.tensor([t, 2]),
                    *drafter.empty_cache(b, 0), torch.zeros(b, dtype=torch.int64))
    before = graphs[0](*target_args), graphs[1](*drafter_args)
    exact.bind(*graphs)
    ops, calls = kernels.ops(), []
    for name in ("linear", "rms_norm", "silu_mul"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, real=real, name=name, **kw: calls.append(
            (name, "norm" if kw.get("norm") else "up" if kw.get("up") is not None else "")) or real(*a, **kw))
    bound = graphs[0](*target_args)
    counts = {call: calls.count(call) for call in set(calls)}
    assert counts == {("linear", "norm"): 2 * layers + 1, ("linear", "up"): layers, ("linear", ""): layers}
    calls.clear()
    bound = bound, graphs[1](*drafter_args)
    counts = {call: calls.count(call) for call in set(calls)}
    assert counts == {("rms_norm", ""): 3 * 2, ("linear", "norm"): 2, ("linear", "up"): 2, ("linear", ""): 2 * 3 + 1}
    for got, want in zip(bound[0] + bound[1], before[0] + before[1]):
        if want.is_floating_point():
            assert (got - want).abs().max() <= 1e-4 * want.abs().max()
        else:
            assert torch.equal(got, want)
