"""ONNX export: ONNX Runtime (CPU) against the torch modules, a speculative loop run on ORT sessions alone,
strong typing, and the `export` command.

Tolerances (ORT vs the fp32 torch module, tiny random models):
  fp32: logits, probabilities, K/V within 1e-4; greedy and draft ids identical. (The 30-layer sample
        target: logits, aux and K/V within 1e-4 of their largest magnitude, probabilities 1e-4.)
  fp16 (ORT CPU): logits within 2e-2, probabilities within 1e-2; >= 99.5% greedy-id agreement.
  bf16: ORT CPU has no bf16 kernel for Add, Mul, Div, Neg, MatMul, Sigmoid or Where, so bf16
        graphs run through onnx.reference.ReferenceEvaluator: logits within 0.1; greedy ids agree on
        >= 99.5% of positions whose fp32 top-2 margin exceeds 0.02 (>= 97% of all positions: the tiny
        random model's near-ties flip under bf16 rounding, in torch's own bf16 run as well).
"""

import json

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from tiny_models import write_tiny_drafter, write_tiny_target

from eagle_export.cli import main
from eagle_export.errors import EagleExportError
from eagle_export.export import loader
from eagle_export.export.export import (
    EXAMPLE_SIZES,
    ONNX_IR_VERSION,
    export_drafter,
    export_graph,
    export_models,
    export_target,
)
from eagle_export.export.unrolled import TargetGraph, UnrolledDrafter
from eagle_export.models import contract as C
from eagle_export.models.checkpoint import load_drafter, load_target
from eagle_export.models.layers import causal_mask
from eagle_export.runtime.backends import ort_session, run_onnx
from eagle_export.speculation.tree import DynamicTree, TreeShape, verify_mask

pytestmark = pytest.mark.usefixtures("no_grad")
AUX = (1, 3, 4)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {"target": write_tiny_target(root / "t", "llama", seed=1),
            "3": write_tiny_drafter(root / "d3", "3", seed=2),
            "3.1": write_tiny_drafter(root / "d31", "3.1", seed=3),
            "3.1-window": write_tiny_drafter(root / "d31w", "3.1", seed=3, layer_types=["sliding_attention"],
                                             sliding_window=3)}


def load_pair(dirs, version, dtype=None):
    target = load_target(dirs["target"], dtype=dtype, aux_layer_ids=AUX)
    return target, load_drafter(dirs[version], target=target, dtype=dtype)


def drafter_inputs(drafter, depth, num_valid, cache_lens, past, sampling, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    cfg, batch, width = drafter.config, len(num_valid), depth + 1
    shape = (1, batch, cfg.num_kv_heads, past, cfg.head_dim)
    args = (torch.randint(0, cfg.vocab_size, (batch, width), generator=g),
            torch.randn(batch, width, cfg.num_aux * cfg.target_hidden_size, generator=g).to(dtype),
            torch.tensor(num_valid), torch.randn(shape, generator=g).to(dtype),
            torch.randn(shape, generator=g).to(dtype), torch.tensor(cache_lens))
    if sampling:
        args += (torch.rand(batch, generator=g) + 0.5, torch.rand(batch, depth, generator=g))
    return args


def target_inputs(target, batch, tokens, cache_lens, past, seed=0, dtype=torch.float32, tree=False):
    """Causal new tokens, or (tree) a random token tree's: root + tokens-1 nodes at their depths."""
    g = torch.Generator().manual_seed(seed)
    cfg = target.config
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, past, cfg.head_dim)
    cache_lens = torch.tensor(cache_lens)
    mask = causal_mask(batch, tokens)
    if tree:
        mask = verify_mask(torch.stack([torch.randint(-1, i, (batch,), generator=g) for i in range(tokens - 1)], 1))
    return (torch.randint(0, cfg.vocab_size, (batch, tokens), generator=g),
            cache_lens[:, None] + mask.sum(-1) - 1, torch.randn(shape, generator=g).to(dtype),
            torch.randn(shape, generator=g).to(dtype), cache_lens, mask)


def as_float(args):
    return tuple(a.float() if a.is_floating_point() else a for a in args)


def compare(spec, got, expected, tol, relative=False):
    """Ids identical, floats within `tol` (times the tensor's largest magnitude, when `relative`)."""
    for name, e in zip(spec.output_names, expected):
        g = got[name]
        assert g.shape == e.shape, name
        if e.dtype == torch.int64:
            assert torch.equal(g, e), name
        else:
            bound = tol * max(1.0, float(e.abs().max())) if relative else tol
            assert (g - e.float()).abs().max() <= bound, (name, float((g - e.float()).abs().max()))


# ---------------------------------------------------------------- fp32: ORT equals torch

@pytest.mark.parametrize("version,depth,sampling", [("3", 1, False), ("3", 4, True), ("3", 8, False),
                                                    ("3.1", 1, True), ("3.1", 4, False), ("3.1", 8, True),
                                                    ("3.1-window", 4, True)])
def test_drafter_onnx_matches_torch_fp32(tmp_path, dirs, version, depth, sampling):
    _, drafter = load_pair(dirs, version)
    path = tmp_path / "drafter.onnx"
    export_drafter(drafter, depth, sampling, path)
    session, spec = ort_session(path), C.drafter_graph(drafter.config, TreeShape.chain(depth), sampling)
    module = UnrolledDrafter(drafter, depth, sampling)
    # batch 1 and ragged batch 3 at sizes other than the export example's, and an empty cache (S = 0)
    for num_valid, cache_lens, past in [([depth], [5], 7), ([1, depth + 1, 2], [0, 9, 4], 12), ([2, 1], [0, 0], 0)]:
        args = drafter_inputs(drafter, depth, num_valid, cache_lens, past, sampling, seed=depth)
        compare(spec, run_onnx(session, spec.feeds(args)), module(*args), 1e-4)


@pytest.mark.parametrize("return_logits", [True, False])
def test_target_onnx_matches_torch_fp32(tmp_path, dirs, return_logits):
    target, _ = load_pair(dirs, "3")
    path = tmp_path / "target.onnx"
    export_target(target, path, return_logits)
    session, spec = ort_session(path), C.target_graph(target.config, len(AUX), return_logits)
    module = TargetGraph(target, return_logits)
    for batch, tokens, cache_lens, past, tree in [(1, 9, [0], 0, False), (3, 5, [6, 0, 2], 8, False),
                                                  (2, 1, [3, 7], 7, False), (2, 9, [3, 7], 7, True)]:
        args = target_inputs(target, batch, tokens, cache_lens, past, seed=tokens, tree=tree)
        compare(spec, run_onnx(session, spec.feeds(args)), module(*args), 1e-4)


# ---------------------------------------------------------------- fp16 / bf16

def float_type_of_inputs(model, op_types):
    """elem types of the first input of every node of `op_types`, after strict type inference."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    types = {v.name: v.type.tensor_type.elem_type
             for v in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    return {types.get(n.input[0]) for n in model.graph.node if n.op_type in op_types}


@pytest.fixture(scope="module")
def fp16_models(dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp16")
    summary = export_models(dirs["target"], dirs["3.1"], 4, "fp16", out, sampling=True)
    return out, summary


def test_fp16_graphs_are_strongly_typed(fp16_models):
    out, summary = fp16_models
    for name in ("target.onnx", "drafter.onnx", "drafter_sampling.onnx"):
        model = onnx.load(str(out / name))
        onnx.checker.check_model(model, full_check=True)
        assert model.ir_version == ONNX_IR_VERSION
        assert {o.version for o in model.opset_import if o.domain in ("", "ai.onnx")} == {C.ONNX_OPSET}
        # softmax, norm statistics and cumulative probabilities run in fp32, behind explicit casts
        assert float_type_of_inputs(model, {"Softmax", "ReduceMean", "CumSum"}) == {onnx.TensorProto.FLOAT}
        assert float_type_of_inputs(model, {"MatMul"}) == {onnx.TensorProto.FLOAT16}
    assert summary["target"]["nodes_exported"] > 0 and summary["drafter"]["export_seconds"] > 0


def greedy_agreement(got, expected):
    return float((got == expected).float().mean())


def test_fp16_ort_agrees_with_fp32_torch(fp16_models, dirs):
    out, _ = fp16_models
    # the pair as `export` makes it: through the model passes (EAGLE-3.1's fc norm moved into the target)
    target32, drafter32 = loader.load_pair(dirs["target"], dirs["3.1"], torch.float32)
    target16, drafter16 = load_pair(dirs, "3.1", torch.float16)
    spec = C.target_graph(target16.config, len(AUX), True)
    args = target_inputs(target16, 4, 64, [0, 5, 11, 2], 12, dtype=torch.float16)
    got = run_onnx(ort_session(out / "target.onnx"), spec.feeds(args))
    greedy, logits, *_ = TargetGraph(target32, True)(*as_float(args))
    assert (got["logits"] - logits).abs().max() <= 2e-2
    assert greedy_agreement(got["greedy_ids"], greedy) >= 0.995

    spec = C.drafter_graph(drafter16.config, TreeShape.chain(4), True)
    session, module = ort_session(out / "drafter_sampling.onnx"), UnrolledDrafter(drafter32, 4, True)
    agree = []
    for seed in range(8):
        args = drafter_inputs(drafter16, 4, [5, 1, 3, 4], [3, 0, 8, 6], 9, True, seed, torch.float16)
        got, expected = run_onnx(session, spec.feeds(args)), module(*as_float(args))
        assert (got["draft_probs"] - expected[2]).abs().max() <= 1e-2
        agree.append(greedy_agreement(got["draft_ids"], expected[0]))
    assert np.mean(agree) >= 0.995


def run_reference(path, spec, args):
    """onnx.reference.ReferenceEvaluator on bf16 feeds (ml_dtypes), outputs as fp32/int64 torch tensors."""
    import ml_dtypes
    from onnx.reference import ReferenceEvaluator

    feeds = {n: (a.float().numpy().astype(ml_dtypes.bfloat16) if a.dtype == torch.bfloat16 else a.numpy())
             for n, a in zip(spec.input_names, args)}
    outputs = ReferenceEvaluator(str(path)).run(None, feeds)
    return {n: torch.from_numpy(o.astype(np.float32) if o.dtype != np.int64 else o)
            for n, o in zip(spec.output_names, outputs)}


def test_bf16_reference_agrees_with_fp32_torch(tmp_path, dirs):
    target32, drafter32 = load_pair(dirs, "3")
    target, drafter = load_pair(dirs, "3", torch.bfloat16)
    export_target(target, tmp_path / "target.onnx", return_logits=True)
    export_drafter(drafter, 4, False, tmp_path / "drafter.onnx")
    spec = C.target_graph(target.config, len(AUX), True)
    args = target_inputs(target, 4, 32, [0, 5, 11, 2], 12, dtype=torch.bfloat16)
    got = run_reference(tmp_path / "target.onnx", spec, args)
    greedy, logits, *_ = TargetGraph(target32, True)(*as_float(args))
    assert (got["logits"] - logits).abs().max() <= 0.1
    # The tiny random target's top-2 logit margins are often below bf16's rounding (~0.005 here), so
    # near-ties flip: >= 99.5% agreement where the fp32 margin exceeds 0.02, >= 97% over all positions.
    top2 = logits.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) > 0.02
    assert decisive.float().mean() >= 0.5
    assert greedy_agreement(got["greedy_ids"][decisive], greedy[decisive]) >= 0.995
    assert greedy_agreement(got["greedy_ids"], greedy) >= 0.97

    spec = C.drafter_graph(drafter.config, TreeShape.chain(4), False)
    args = drafter_inputs(drafter, 4, [5, 1, 3, 4], [3, 0, 8, 6], 9, False, 0, torch.bfloat16)
    got, expected = run_reference(tmp_path / "drafter.onnx", spec, args), UnrolledDrafter(drafter32, 4, False)(
        *as_float(args))
    assert greedy_agreement(got["draft_ids"], expected[0]) >= 0.995
    assert (got["draft_token_probs"] - expected[1]).abs().max() <= 0.05


# ---------------------------------------------------------------- the speculative loop on ORT alone

def speculative_greedy(target_session, drafter_session, target, drafter, prompt, max_new, depth):
    """Greedy draft-verify at batch 1 with the runtime's cache bookkeeping: whole-capacity cache views,
    new K/V written at each offset, rollback by length. Returns (tokens, accepted drafts per round)."""
    tspec = C.target_graph(target.config, len(AUX), False)
    dspec = C.drafter_graph(drafter.config, TreeShape.chain(depth), False)
    capacity = len(prompt) + max_new + depth + 1
    tk, tv = target.empty_cache(1, capacity)
    dk, dv = drafter.empty_cache(1, capacity)
    n = len(prompt)
    out = run_onnx(target_session, tspec.feeds((torch.tensor([prompt]), torch.arange(n)[None], tk, tv,
                                                torch.tensor([0]), causal_mask(1, n))))
    tk[:, :, :, :n], tv[:, :, :, :n] = out["new_key"], out["new_value"]
    tokens = [int(out["greedy_ids"][0, -1])]
    # drafter prefill: t_1..t_n with a_0..a_{n-1} in one call (the drafter's tokens axis is dynamic)
    d = run_onnx(drafter_session, dspec.feeds((torch.tensor([prompt[1:] + tokens]), out["aux_hidden"],
                                                torch.tensor([n]), dk, dv, torch.tensor([0]))))
    dk[..., :n, :], dv[..., :n, :] = d["new_key"][..., :n, :], d["new_value"][..., :n, :]
    length, accepted_counts = n, []
    while len(tokens) < max_new:
        drafts = d["draft_ids"][0].tolist()
        verify = torch.tensor([[tokens[-1]] + drafts])
        out = run_onnx(target_session, tspec.feeds((verify, length + torch.arange(depth + 1)[None], tk, tv,
                                                    torch.tensor([length]), causal_mask(1, depth + 1))))
        greedy = out["greedy_ids"][0].tolist()
        m = 0
        while m < depth and drafts[m] == greedy[m]:
            m += 1
        accepted = drafts[:m] + [greedy[m]]
        tk[:, :, :, length:length + depth + 1], tv[:, :, :, length:length + depth + 1] = out["new_key"], out["new_value"]
        ids = torch.zeros(1, depth + 1, dtype=torch.long)
        ids[0, :m + 1] = torch.tensor(accepted)
        aux = torch.zeros_like(out["aux_hidden"])
        aux[:, :m + 1] = out["aux_hidden"][:, :m + 1]
        d = run_onnx(drafter_session, dspec.feeds((ids, aux, torch.tensor([m + 1]), dk, dv, torch.tensor([length]))))
        dk[..., length:length + m + 1, :] = d["new_key"][..., :m + 1, :]
        dv[..., length:length + m + 1, :] = d["new_value"][..., :m + 1, :]
        length += m + 1  # rejected drafts roll back by length alone
        tokens += accepted
        accepted_counts.append(m)
    return tokens[:max_new], accepted_counts


@pytest.fixture(scope="module")
def target_onnx(dirs, tmp_path_factory):
    path = tmp_path_factory.mktemp("target") / "target.onnx"
    export_target(load_pair(dirs, "3")[0], path, return_logits=False)
    return ort_session(path)


@pytest.mark.parametrize("version,drafter_kind", [("3", "random"), ("3", "one_token"), ("3.1", "one_token")])
def test_ort_speculative_loop_reproduces_target_greedy(tmp_path, dirs, target_onnx, version, drafter_kind):
    depth, prompt, max_new = 4, [100, 200, 100, 200, 100], 32  # this target then repeats one token
    target, drafter = load_pair(dirs, version)
    expected = target.generate_greedy(prompt, max_new)
    if drafter_kind == "one_token":
        # A drafter whose vocabulary is the target's most frequent output token: its drafts get accepted,
        # often several in a row, so the accept, pad and rollback paths all run.
        path = write_tiny_drafter(tmp_path / "one", version, seed=5, draft_vocab=1)
        drafter = load_drafter(path, target=target)
        drafter.d2t[0] = max(set(expected), key=expected.count)
    export_drafter(drafter, depth, False, tmp_path / "drafter.onnx")
    tokens, accepted = speculative_greedy(target_onnx, ort_session(tmp_path / "drafter.onnx"),
                                          target, drafter, prompt, max_new, depth)
    assert tokens == expected
    if drafter_kind == "one_token":
        assert max(accepted) == depth  # whole drafts accepted: num_valid = K+1 with a full pad-free row


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_ort_runtime_verifies_random_trees_losslessly(tmp_path, dirs, kind):
    """The runtime on ONNX Runtime with a stand-in tree drafter (random trees of 1..12 nodes whose
    tokens are often the target's own): batch 1 and 2 give the target's greedy output."""
    from random_tree import RandomTrees

    from eagle_export.runtime.backends import OnnxRuntimeBackend
    from eagle_export.runtime.runtime import GenerationConfig, SpeculativeRuntime

    class OrtTrees(RandomTrees, OnnxRuntimeBackend):
        pass

    target, drafter = load_pair(dirs, "3.1")
    export_target(target, tmp_path / "target.onnx", return_logits=False)
    export_drafter(drafter, 4, False, tmp_path / "drafter.onnx")
    prompts = [[100, 200, 100, 200, 100], [7, 8, 9]]
    expected = [p + target.generate_greedy(p, 24) for p in prompts]
    for batch in (1, 2):
        backend = OrtTrees(tmp_path / "target.onnx", tmp_path / "drafter.onnx", continuations=expected[:batch],
                           kind=kind, seed=batch)
        runtime = SpeculativeRuntime.for_models(backend, target, drafter, max_context=64, verify_policy="fixed")
        results = runtime.generate(prompts[:batch], GenerationConfig(max_new_tokens=24))
        assert [r.tokens for r in results] == [full[len(p):] for p, full in zip(prompts[:batch], expected)]
        assert max(backend.widths) > 4 and max(max(r.stats.accepted) for r in results) >= 2


def test_a_target_graph_exported_before_tree_mask_still_runs_chains(tmp_path, dirs):
    """Builds made before the tree_mask input: the backends feed only the inputs a graph declares,
    so the runtime's chains run on such a graph (its causal mask built in-graph) and stay lossless."""
    from eagle_export.runtime.backends import OnnxRuntimeBackend
    from eagle_export.runtime.runtime import GenerationConfig, SpeculativeRuntime

    class WithoutTreeMask(torch.nn.Module):  # the target graph as exported before the input existed
        def __init__(self, graph):
            super().__init__()
            self.graph = graph

        def forward(self, input_ids, positions, past_key, past_value, cache_lens):
            logits, aux, new_key, new_value = self.graph.target(input_ids, positions, past_key, past_value, cache_lens)
            return logits.argmax(-1), aux, new_key, new_value

    target, drafter = load_pair(dirs, "3.1")
    spec = C.target_graph(target.config, len(AUX), False)
    old = C.GraphSpec(tuple(t for t in spec.inputs if t.name != C.TREE_MASK), spec.outputs, spec.vocab_size)
    export_graph(WithoutTreeMask(TargetGraph(target, False)).eval(), C.example_args(old, EXAMPLE_SIZES), old,
                 tmp_path / "target.onnx")
    assert C.TREE_MASK not in [i.name for i in ort_session(tmp_path / "target.onnx").get_inputs()]
    export_drafter(drafter, 3, False, tmp_path / "drafter.onnx")
    backend = OnnxRuntimeBackend(tmp_path / "target.onnx", tmp_path / "drafter.onnx")
    runtime = SpeculativeRuntime.for_models(backend, target, drafter, max_context=64, verify_policy="fixed")
    prompts = [[100, 200, 100, 200, 100], [7, 8, 9]]
    results = runtime.generate(prompts, GenerationConfig(max_new_tokens=20))
    assert [r.tokens for r in results] == [target.generate_greedy(p, 20) for p in prompts]


def test_large_models_keep_their_weights_in_external_data(tmp_path, dirs, monkeypatch):
    import eagle_export.export.export as export_module

    monkeypatch.setattr(export_module, "EXTERNAL_DATA_THRESHOLD", 0)  # what a > 2 GB model gets
    _, drafter = load_pair(dirs, "3.1")
    export_drafter(drafter, 2, False, tmp_path / "drafter.onnx")
    assert (tmp_path / "drafter.onnx.data").stat().st_size > (tmp_path / "drafter.onnx").stat().st_size
    spec = C.drafter_graph(drafter.config, TreeShape.chain(2), False)
    args = drafter_inputs(drafter, 2, [3, 1], [4, 0], 6, False)
    compare(spec, run_onnx(ort_session(tmp_path / "drafter.onnx"), spec.feeds(args)), UnrolledDrafter(drafter, 2, False)(*args),
            1e-4)


# ---------------------------------------------------------------- export_models and the command

def declared_shapes(path) -> dict:
    """Each graph output's declared shape: ints for fixed sizes, names for symbolic ones."""
    return {o.name: tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in o.type.tensor_type.shape.dim)
            for o in onnx.load(str(path), load_external_data=False).graph.output}


def test_export_command_writes_both_graphs(tmp_path, dirs):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", "--target", str(dirs["target"]), "--draft", str(dirs["3"]),
                                       "--depth", "2", "--dtype", "fp32", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "exporting target.onnx" in result.output and "exporting drafter.onnx" in result.output
    summary = json.loads((out / "export_summary.json").read_text())
    assert summary["depth"] == 2 and summary["aux_layer_ids"] == list(AUX)
    target, drafter_model = load_pair(dirs, "3")
    for name, spec in (("target.onnx", C.target_graph(target.config, len(target.aux_layer_ids), False)),
                       ("drafter.onnx", C.drafter_graph(drafter_model.config, TreeShape.chain(2), False))):
        assert declared_shapes(out / name) == {t.name: t.shape for t in spec.outputs}, name  # names and shapes
    again = CliRunner().invoke(main, ["export", "--target", str(dirs["target"]), "--draft", str(dirs["3"]),
                                      "--depth", "2", "-o", str(out)])
    assert again.exit_code == 2 and "--force" in again.output
    deep = CliRunner().invoke(main, ["export", "--target", str(dirs["target"]), "--draft", str(dirs["3"]),
                                     "--depth", "9", "-o", str(tmp_path / "deep")])
    assert deep.exit_code == 2 and "depth" in deep.output and "Traceback" not in deep.output


def test_export_sampling_writes_the_greedy_drafter_too_and_swapped_graphs_are_refused(fp16_models, dirs, tmp_path):
    """Repro: `export --sampling` wrote only the sampling drafter, as drafter.onnx, and greedy decoding
    on it failed with a bare KeyError: 'temperature'."""
    from eagle_export.runtime.backends import OnnxRuntimeBackend
    from eagle_export.runtime.runtime import GenerationConfig, SpeculativeRuntime

    out, summary = fp16_models
    names = {i.name for i in ort_session(out / "drafter.onnx").get_inputs()}
    assert C.TEMPERATURE not in names and summary["drafter_sampling"]["nodes_exported"] > 0
    target = load_target(dirs["target"], dtype=torch.float16, aux_layer_ids=AUX)
    drafter = load_drafter(dirs["3.1"], target=target, dtype=torch.float16)
    backend = OnnxRuntimeBackend(out / "target.onnx", out / "drafter.onnx", out / "drafter_sampling.onnx")
    runtime = SpeculativeRuntime.for_models(backend, target, drafter, max_context=64)
    [result] = runtime.generate([[5, 6, 7]], GenerationConfig(max_new_tokens=6))
    assert len(result.tokens) == 6
    with pytest.raises(EagleExportError, match="drafter_sampling.onnx is a sampling drafter graph, given where the "
                                               "greedy one goes"):
        OnnxRuntimeBackend(out / "target.onnx", out / "drafter_sampling.onnx")


def assert_every_variant_has(bound, variants):
    """`bound` ({role: (inputs, outputs)}) names exactly what every spec of each role has, optional inputs
    aside."""
    for role, specs in variants.items():
        for names, got in zip((lambda s: s.input_names, lambda s: s.output_names), bound[role]):
            shared = {n for n in names(specs[0]) if all(n in names(s) for s in specs)} - set(C.OPTIONAL_INPUTS)
            assert set(got) == shared, (role, got, shared)


# What BOUND_NAMES read before it was derived from the specs (written out by hand).
WRITTEN_OUT = {"target": ((C.INPUT_IDS, C.POSITIONS, C.PAST_KEY, C.PAST_VALUE, C.CACHE_LENS),
                          (C.GREEDY_IDS, C.AUX_HIDDEN, C.NEW_KEY, C.NEW_VALUE)),
               "drafter": ((C.INPUT_IDS, C.AUX_HIDDEN, C.NUM_VALID, C.PAST_KEY, C.PAST_VALUE, C.CACHE_LENS),
                           (C.DRAFT_IDS, C.DRAFT_TOKEN_PROBS, C.NEW_KEY, C.NEW_VALUE))}


@pytest.mark.parametrize(("table", "renamed"), [("derived", False), ("derived", True), ("written out", True)],
                         ids=["as exported", "an input renamed", "planted: written out, renamed"])
def test_the_names_a_graph_is_refused_without_are_those_every_spec_has(dirs, monkeypatch, table, renamed):
    """contract.BOUND_NAMES (a graph lacking one is refused by name) is what every variant of the real specs
    has (the tiny pair's configs; a chain, a static and a dynamic tree; greedy and sampling; with and without
    logits), optional inputs aside, and follows an input renamed in the contract (cache_lens -> seq_lens).
    Planted: the table written out by hand, which the rename leaves stale."""
    if renamed:
        monkeypatch.setattr(C, "CACHE_LENS", "seq_lens")
    target, drafter = load_pair(dirs, "3.1")
    trees = (TreeShape.chain(3), TreeShape((-1, -1, 0, 1)), DynamicTree(2, 3, 4))
    variants = {"target": [C.target_graph(target.config, len(AUX), logits) for logits in (False, True)],
                "drafter": [C.drafter_graph(drafter.config, tree, sampling) for tree in trees
                            for sampling in (False, True)]}
    bound = WRITTEN_OUT if table == "written out" else C.bound_names() if renamed else C.BOUND_NAMES
    if table == "written out":
        with pytest.raises(AssertionError):
            assert_every_variant_has(bound, variants)
    else:
        assert_every_variant_has(bound, variants)
        assert ("seq_lens" in bound["target"][0]) is renamed


@pytest.mark.parametrize("graph, output", [("target.onnx", C.GREEDY_IDS), ("target.onnx", C.NEW_KEY),
                                           ("drafter.onnx", C.DRAFT_IDS)])
def test_a_graph_without_an_output_the_runtime_binds_is_refused_by_name(fp16_models, tmp_path, graph, output):
    """A hand-made or foreign graph lacking an output the runtime reads (ended in a bare KeyError at the
    first call); a target without logits is one the runtime runs (greedy)."""
    from eagle_export.runtime.backends import OnnxRuntimeBackend

    out, _ = fp16_models
    for name in ("target.onnx", "drafter.onnx"):
        model = onnx.load(str(out / name))
        if name == graph:
            kept = [o for o in model.graph.output if o.name != output]
            assert len(kept) == len(model.graph.output) - 1
            del model.graph.output[:]
            model.graph.output.extend(kept)
        onnx.save(model, str(tmp_path / name))
    role = graph.removesuffix(".onnx")
    with pytest.raises(EagleExportError, match=f"{graph} is not a {role} graph eagle-export can run: it has no "
                                               f"output {output}") as refused:
        OnnxRuntimeBackend(tmp_path / "target.onnx", tmp_path / "drafter.onnx")
    assert "export it again" in refused.value.fix


def test_duplicated_aux_ids_are_refused_where_they_enter(tmp_path, dirs):
    """Repro: duplicated aux layer ids passed `inspect`, then `export` failed with "a bug in the export"."""
    twice = write_tiny_drafter(tmp_path / "twice", "3", aux=(1, 3, 3))
    result = CliRunner().invoke(main, ["inspect", str(twice), "--json"])
    assert result.exit_code == 0 and "name layer(s) [3] more than once" in " ".join(json.loads(result.output)["warnings"])
    result = CliRunner().invoke(main, ["export", "--target", str(dirs["target"]), "--draft", str(twice),
                                       "-o", str(tmp_path / "o")])
    assert result.exit_code == 2 and "aux layer ids [1, 3, 3] name layer(s) [3] more than once" in result.output
    assert "bug" not in result.output


@pytest.mark.parametrize("quantized", [False, True])
def test_a_lint_finding_fails_the_export_quantized_or_not(tmp_path, quantized):
    class Determinant(torch.nn.Module):  # ONNX Det: not in TensorRT's parser support table
        def forward(self, x):
            return torch.linalg.det(x)

    spec = C.GraphSpec((C.TensorSpec("x", (2, 3, 3), "float32"),), (C.TensorSpec("det", (2,), "float32"),))
    with pytest.raises(EagleExportError, match="det.onnx fails the TensorRT lint: .*Det"):
        export_graph(Determinant(), (torch.randn(2, 3, 3),), spec, tmp_path / "det.onnx", quantized=quantized)
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("depth,dtype,problem", [(0, "fp32", "depth"), (9, "fp16", "depth"),
                                                  (4, "int3", "dtype")])
def test_bad_export_arguments_are_refused(tmp_path, dirs, depth, dtype, problem):
    with pytest.raises(EagleExportError, match=problem):
        export_models(dirs["target"], dirs["3"], depth, dtype, tmp_path / "o")


def test_mismatched_pair_is_refused(tmp_path, dirs):
    other = write_tiny_drafter(tmp_path / "wide", "3", target_hidden=96, vocab=320)
    with pytest.raises(EagleExportError, match="hidden size"):
        export_models(dirs["target"], other, 4, "fp32", tmp_path / "o")


# ---------------------------------------------------------------- the sample target

@pytest.fixture(scope="module")
def sample_with_drafter(sample_target, tmp_path_factory):
    """The sample target (aux layers 2, 15, 27) and a random drafter of its width, loaded once for the
    depths below (each test exports them and runs them; none changes them)."""
    path = write_tiny_drafter(tmp_path_factory.mktemp("d"), "3.1", seed=0, target_hidden=576, vocab=49152,
                              draft_vocab=4096, aux=(2, 15, 27), hidden_size=576, num_attention_heads=9,
                              num_key_value_heads=3, intermediate_size=1536)
    target = load_target(sample_target, aux_layer_ids=(2, 15, 27))
    return target, load_drafter(path, target=target)


@pytest.mark.sample
@pytest.mark.slow
@pytest.mark.parametrize("depth", [1, 4, 8])
def test_sample_target_and_drafter_onnx_match_torch(tmp_path, sample_with_drafter, depth):
    target, drafter = sample_with_drafter
    if depth == 4:
        export_target(target, tmp_path / "target.onnx", return_logits=True)
        spec = C.target_graph(target.config, 3, True)
        args = target_inputs(target, 2, 6, [0, 4], 5)
        got, expected = run_onnx(ort_session(tmp_path / "target.onnx"), spec.feeds(args)), TargetGraph(target, True)(*args)
        # 30 layers of fp32 rounding reach ~2.5e-4 on logits near 15: logits, aux and K/V are held to
        # 1e-4 of their largest magnitude, the probabilities to 1e-4 absolute, the greedy ids exactly.
        compare(spec, got, expected, 1e-4, relative=True)
        probs = (torch.softmax(got["logits"], -1) - torch.softmax(expected[1], -1)).abs().max()
        assert probs <= 1e-4
    export_drafter(drafter, depth, True, tmp_path / "drafter.onnx")
    spec = C.drafter_graph(drafter.config, TreeShape.chain(depth), True)
    args = drafter_inputs(drafter, depth, [depth + 1, 2], [7, 0], 9, True)
    compare(spec, run_onnx(ort_session(tmp_path / "drafter.onnx"), spec.feeds(args)),
            UnrolledDrafter(drafter, depth, True)(*args), 1e-4, relative=True)  # probabilities: absolute


def test_onnxruntime_backend_takes_its_device_from_the_session_and_binds_io(tmp_path, dirs):
    """CUDA asked for where ORT has none: the session runs on the CPU provider, so the backend's
    device (where the runtime allocates the caches) must be the CPU (before: 'cuda' from the
    request, and the first call crashed). The loop runs through IO binding, the path the CUDA
    provider takes, with inputs and outputs bound by torch tensor address, and stays lossless."""
    from eagle_export.runtime.backends import OnnxRuntimeBackend
    from eagle_export.runtime.runtime import GenerationConfig, SpeculativeRuntime

    target, drafter = load_pair(dirs, "3.1")
    export_target(target, tmp_path / "target.onnx", return_logits=True)
    export_drafter(drafter, 3, False, tmp_path / "drafter.onnx")
    with pytest.warns(UserWarning, match="CUDAExecutionProvider"):
        backend = OnnxRuntimeBackend(tmp_path / "target.onnx", tmp_path / "drafter.onnx",
                                     providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert backend.providers == ["CPUExecutionProvider"] and backend.device == "cpu"
    runtime = SpeculativeRuntime.for_models(backend, target, drafter, max_context=64, verify_policy="fixed")
    prompts = [[100, 200, 100, 200, 100], [7, 8, 9]]
    results = runtime.generate(prompts, GenerationConfig(max_new_tokens=20))
    assert [r.tokens for r in results] == [target.generate_greedy(p, 20) for p in prompts]
    cfg = target.config
    cache = torch.zeros(cfg.num_layers, 1, cfg.num_kv_heads, 3, cfg.head_dim)
    feeds = {C.INPUT_IDS: torch.tensor([[5, 6]]), C.POSITIONS: torch.tensor([[3, 4]]), C.PAST_KEY: cache,
             C.PAST_VALUE: cache, C.CACHE_LENS: torch.full((1,), 3), C.TREE_MASK: causal_mask(1, 2)}
    out = backend.target(feeds, need_logits=True)
    assert out[C.LOGITS].shape == (1, 2, cfg.vocab_size)
    assert out[C.NEW_KEY].shape == (cfg.num_layers, 1, cfg.num_kv_heads, 2, cfg.head_dim)
    with pytest.raises(EagleExportError, match="input past_key is torch.float16 on cpu, the session takes "
                                               "torch.float32 on cpu"):
        backend.target({**feeds, C.PAST_KEY: cache.half()})


def test_output_shapes_follow_the_contract_axes_and_the_cache_layout():
    from types import SimpleNamespace as NS

    from eagle_export.runtime.backends import output_shapes, provider_device

    session = NS(get_inputs=lambda: [NS(name="input_ids", shape=["batch", "tokens"]),
                                     NS(name="past_key", shape=[1, "batch", 3, "past", 64])],
                 get_outputs=lambda: [NS(name="draft_ids", shape=["batch", 4]),
                                      NS(name="new_key", shape=[1, "batch", 3, "tokens_plus_depth_minus_1",
                                                                "Unsqueezenew_key_dim_4"])])
    feeds = {"input_ids": torch.zeros(2, 5), "past_key": torch.zeros(1, 2, 3, 64, 64)}
    assert output_shapes(session, feeds, step_rows=3, nodes=4) == {"draft_ids": (2, 4), "new_key": (1, 2, 3, 8, 64)}
    assert provider_device(["CUDAExecutionProvider", "CPUExecutionProvider"]) == "cuda"
    assert provider_device(["CPUExecutionProvider"]) == "cpu"


@pytest.mark.parametrize("speculation", ["chain", "tree"])
def test_no_tracer_warning_reaches_the_user(tmp_path, dirs, speculation):
    """Tracing a chain warns of nothing; a static tree's structural constants are traced as constants,
    which is meant: those warnings go to the export report, never to the terminal."""
    import warnings

    from eagle_export.speculation.tree import TreeShape

    _, drafter = load_pair(dirs, "3.1")
    shape = 3 if speculation == "chain" else TreeShape.from_branching([2, 2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = export_drafter(drafter, shape, False, tmp_path / "drafter.onnx")
    assert not [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]
    if speculation == "chain":
        assert report["trace_warnings"] == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_tied_table_is_stored_once_in_the_target_graph(tmp_path, dtype):
    """The embedding Gather and the logits Gemm (transB) read one initializer; before, lm_head exported
    as MatMul on a constant-folded transposed copy: a second V x H table (+21% on Llama-3.2-1B)."""
    path = write_tiny_target(tmp_path / "tied", "smollm2", vocab_size=2048)
    target = load_target(path, dtype=dtype, aux_layer_ids=AUX)
    export_target(target, tmp_path / "target.onnx", return_logits=True)
    graph = onnx.load(str(tmp_path / "target.onnx")).graph
    tables = [tuple(i.dims) for i in graph.initializer if 2048 in i.dims]
    assert tables == [(2048, 64)]
    spec = C.target_graph(target.config, len(AUX), True)
    args = target_inputs(target, 2, 5, [3, 0], 4, dtype=dtype)
    expected = TargetGraph(load_target(path, aux_layer_ids=AUX), True)(*as_float(args))
    compare(spec, run_onnx(ort_session(tmp_path / "target.onnx"), spec.feeds(args)), expected,
            1e-4 if dtype == torch.float32 else 2e-2, relative=True)
