"""Translation validation of the model passes: outputs before and after each pass, on tiny random
models of several families with random non-trivial gains, for EAGLE-3 and EAGLE-3.1 drafters.

Compared outputs: target logits, aux states and new K/V; drafter step-0 logits, feedback state and
new K/V (fed the target's aux states), one feedback step, and the draft->target id map. The error
measure is max|a - b| / max|a| per output. fp32 tolerance 1e-5. bf16 tolerance BF16_TOL: a fold
rounds W*g to bf16 once where the unfolded model rounds g*n(x) once, so each side carries
independent bf16 roundings (2^-9 relative each) that the 6 layers compound. Measured: at most 0.024 over the
families and both versions, the size of bf16's own error against fp32 (0.011-0.021); BF16_TOL is
twice that, far below what a misplaced gain does (~0.3). The bf16 test also checks the rewritten
model is no further from the fp32 outputs than 1.5x the unrewritten bf16 model is.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import write_tiny_drafter, write_tiny_target

from eagle_export.errors import EagleExportError
from eagle_export.models.checkpoint import load_drafter, load_target
from eagle_export.models.config import DrafterConfig, read_config_json
from eagle_export.models.layers import rms_normalize
from eagle_export.passes.draft_vocab import ApplyDraftVocab, ShareEmbeddings
from eagle_export.passes.fold_norms import FoldFcNorm, FoldFcNormIntoTarget, FoldNormGains
from eagle_export.passes.fuse_projections import FuseGateUp, FuseQKV
from eagle_export.passes.model_pipeline import EagleModels, all_passes, model_pipeline

FP32_TOL = 1e-5
BF16_TOL = 5e-2
FAMILIES = ["llama", "llama3", "mistral", "qwen2", "qwen3", "smollm2"]
VERSIONS = ["3", "3.1"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("model_passes")
    paths = {family: write_tiny_target(root / family, family, seed=i) for i, family in enumerate(FAMILIES)}
    for version in VERSIONS:
        paths[f"drafter{version}"] = write_tiny_drafter(root / f"drafter{version}", version, seed=7)
    paths["drafter_own"] = write_tiny_drafter(root / "drafter_own", "3.1", seed=8, own_embeddings=True)
    paths["drafter_nbr"] = write_tiny_drafter(root / "drafter_nbr", "3", seed=9, norm_before_residual=True)
    paths["drafter_nbfc"] = write_tiny_drafter(root / "drafter_nbfc", "3", seed=10, norm_before_fc=True)
    paths["drafter_fc_norm_nbfc"] = write_tiny_drafter(root / "drafter_fc_norm_nbfc", "3.1", seed=12,
                                                       norm_before_fc=True)
    paths["drafter_identity"] = write_tiny_drafter(root / "drafter_identity", "3.1", seed=11, draft_vocab=320)
    return paths


_LOADED: dict[tuple, EagleModels] = {}


def load_pair(checkpoints, family, drafter="drafter3.1", dtype=torch.float32) -> EagleModels:
    """A fresh copy of the pair (each loaded once per module): tests may rewrite it freely."""
    key = (str(checkpoints[family]), drafter, dtype)
    if key not in _LOADED:
        target = load_target(checkpoints[family], dtype=dtype)
        drafter_cfg = DrafterConfig.from_hf(read_config_json(checkpoints[drafter]))
        target.aux_layer_ids = drafter_cfg.resolved_aux_layer_ids(target.config)
        _LOADED[key] = EagleModels(target, load_drafter(checkpoints[drafter], target=target, dtype=dtype))
    return copy.deepcopy(_LOADED[key])


def run_pair(models: EagleModels, seed: int = 0) -> dict[str, torch.Tensor]:
    """Both models on the same random inputs: a ragged batch over a random cache, then a drafter
    step 0 on the target's aux states and one feedback step."""
    t, d = models.target, models.drafter
    tc, dc = t.config, d.config
    dtype = t.embed_tokens.weight.dtype
    g = torch.Generator().manual_seed(seed)
    batch, tokens, past = 2, 5, 3
    cache_lens = torch.tensor([3, 1])
    positions = cache_lens[:, None] + torch.arange(tokens)
    ids = torch.randint(0, tc.vocab_size, (batch, tokens), generator=g)

    def cache(layers, heads, head_dim):
        return [torch.randn(layers, batch, heads, past, head_dim, generator=g).to(dtype) for _ in range(2)]

    with torch.no_grad():
        logits, aux, new_k, new_v = t(ids, positions, *cache(tc.num_layers, tc.num_kv_heads, tc.head_dim), cache_lens)
        out = {"target_logits": logits, "aux": aux, "target_new_k": new_k, "target_new_v": new_v}
        d_cache = cache(1, dc.num_kv_heads, dc.head_dim)
        logits, feedback, new_k, new_v = d(ids, d.fuse_aux(aux), positions, *d_cache, cache_lens)
        out.update(drafter_logits=logits, drafter_feedback=feedback, drafter_new_k=new_k, drafter_new_v=new_v)
        next_ids = torch.randint(0, tc.vocab_size, (batch, 1), generator=g)
        logits, feedback, new_k, new_v = d(next_ids, feedback[:, -1:], positions[:, -1:] + 1, *d_cache, cache_lens)
        out.update(step1_logits=logits, step1_feedback=feedback, step1_new_k=new_k, step1_new_v=new_v)
        out["target_ids"] = d.to_target_ids(torch.arange(dc.draft_vocab_size))
    return out


def relative_errors(before: dict, after: dict, skip=()) -> dict[str, float]:
    errors = {}
    for key, a in before.items():
        if key in skip:
            continue
        b = after[key]
        assert a.shape == b.shape and a.dtype == b.dtype, key
        if not a.is_floating_point():
            errors[key] = 0.0 if torch.equal(a, b) else float("inf")
            continue
        scale = a.float().abs().max().clamp_min(1e-30)
        errors[key] = float((a.float() - b.float()).abs().max() / scale)
    return errors


def validate(models: EagleModels, transform, tol: float, skip=()) -> tuple[EagleModels, dict[str, float]]:
    """Run `transform` on a copy of `models`; assert every output agrees within `tol`."""
    before = run_pair(models)
    rewritten = transform(copy.deepcopy(models))
    after = run_pair(rewritten)
    errors = relative_errors(before, after, skip)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tol, f"{worst}: relative error {errors[worst]:.3g} > {tol} ({errors})"
    return rewritten, errors


def apply(pass_):
    def transform(models):
        result = pass_(models)
        assert result.modified and result.skipped is None, result.skipped
        again = pass_(result.model)  # idempotent: a second run changes nothing
        assert not again.modified and again.skipped, "second run should be a no-op with a reason"
        return result.model
    return transform


PASSES = [FoldFcNorm, FoldFcNormIntoTarget, FoldNormGains, FuseQKV, FuseGateUp, ApplyDraftVocab]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("pass_class", PASSES, ids=lambda c: c.name)
def test_pass_preserves_outputs_fp32(checkpoints, family, version, pass_class):
    models = load_pair(checkpoints, family, f"drafter{version}")
    if pass_class in (FoldFcNorm, FoldFcNormIntoTarget) and version == "3":
        assert pass_class()(models).skipped == "drafter has no fc_norm (EAGLE-3)"
        return
    skip = ("aux",) if pass_class is FoldFcNormIntoTarget else ()
    rewritten, _ = validate(models, apply(pass_class()), FP32_TOL, skip)
    if pass_class is FoldFcNormIntoTarget:  # the target now emits each aux chunk normalized
        before = run_pair(models)["aux"].split(64, dim=-1)
        expected = torch.cat([rms_normalize(a, models.drafter.config.rms_norm_eps) for a in before], dim=-1)
        assert torch.equal(run_pair(rewritten)["aux"], expected)
        assert rewritten.drafter.fc_norm is None and rewritten.drafter.aux_normalized_by_target


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("version", VERSIONS)
def test_pipeline_preserves_outputs_bf16(checkpoints, family, version):
    models = load_pair(checkpoints, family, f"drafter{version}", dtype=torch.bfloat16)
    reference = run_pair(load_pair(checkpoints, family, f"drafter{version}"))  # fp32
    bf16_error = max(relative_errors(reference, _cast(run_pair(models), torch.float32)).values())
    for placement in ("drafter", "target"):
        skip = ("aux",) if placement == "target" and version == "3.1" else ()
        rewritten, errors = validate(models, lambda m: model_pipeline(placement)(m).model, BF16_TOL, skip)
        # and the rewritten bf16 model is no further from fp32 than bf16 itself is
        rewritten_error = max(relative_errors(reference, _cast(run_pair(rewritten), torch.float32), skip).values())
        assert rewritten_error <= 1.5 * bf16_error, (rewritten_error, bf16_error)


def _cast(outputs: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in outputs.items()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("placement", ["drafter", "target"])
def test_pipeline_composed_fp32(checkpoints, family, version, placement):
    models = load_pair(checkpoints, family, f"drafter{version}")
    before = run_pair(models)
    result = model_pipeline(placement)(copy.deepcopy(models))
    skip = ("aux",) if placement == "target" and version == "3.1" else ()
    errors = relative_errors(before, run_pair(result.model), skip)
    assert max(errors.values()) <= FP32_TOL, errors
    records = {r.name: r for r in result.records}
    assert records["fuse_qkv"].changes["modules_fused"] == 7  # 6 target layers + the drafter's
    assert records["share_embeddings"].skipped == "the drafter already shares the target's embedding table"
    if version == "3":
        assert records[f"fold_fc_norm{'_into_target' if placement == 'target' else ''}"].skipped == \
            "drafter has no fc_norm (EAGLE-3)"
    removed = sum(r.changes.get("params_removed", 0) for r in result.records)
    stats_before, stats_after = models.stats(), result.model.stats()
    assert stats_after["parameters"] == stats_before["parameters"] - removed
    assert stats_after["modules"] < stats_before["modules"]
    again = model_pipeline(placement)(result.model)
    assert not again.modified, [r.name for r in again.records if r.modified]


def test_fold_norm_gains_folds_where_exact(checkpoints):
    models = load_pair(checkpoints, "smollm2", "drafter3.1")
    fold = FoldNormGains()
    result = fold(models)
    # 6 layers x 2 norms; the drafter's input_layernorm, hidden_norm, post_attention_layernorm
    assert result.changes["norms_folded"] == 15
    assert set(fold.kept) == {"target.norm", "drafter.norm"}
    assert "tied" in fold.kept["target.norm"] and "norm_output" in fold.kept["drafter.norm"]
    t, d = result.model.target, result.model.drafter
    assert all(layer.input_layernorm.weight is None and layer.post_attention_layernorm.weight is None
               for layer in t.layers)
    assert t.norm.weight is not None and t.lm_head.weight is t.embed_tokens.weight
    assert d.midlayer.hidden_norm.weight is None and d.norm.weight is not None
    assert "kept: target.norm" in fold(result.model).skipped


def test_fold_norm_gains_qwen3_keeps_qk_norm(checkpoints):
    models = load_pair(checkpoints, "qwen3", "drafter3")
    result = FoldNormGains()(models)
    attn = result.model.target.layers[0].self_attn
    assert attn.q_norm.weight is not None and attn.k_norm.weight is not None
    assert result.model.target.norm.weight is None  # untied lm_head: folded
    assert result.model.drafter.norm.weight is None  # EAGLE-3 feeds back the pre-norm state


def test_fold_norm_gains_norm_before_residual_keeps_hidden_norm(checkpoints):
    models = load_pair(checkpoints, "llama", "drafter_nbr")
    fold = FoldNormGains()
    result = fold(copy.deepcopy(models))
    assert "norm_before_residual" in fold.kept["drafter.midlayer.hidden_norm"]
    assert result.model.drafter.midlayer.hidden_norm.weight is not None
    validate(models, apply(FoldNormGains()), FP32_TOL)


def test_norm_before_fc(checkpoints):
    models = load_pair(checkpoints, "llama", "drafter_nbfc")
    rewritten, _ = validate(models, apply(FoldNormGains()), FP32_TOL)
    assert rewritten.drafter.input_norm.weight is None
    both = load_pair(checkpoints, "llama", "drafter_fc_norm_nbfc")  # fc_norm, then one norm over the concat
    for fold in (FoldFcNorm(), FoldFcNormIntoTarget()):
        assert "norm_before_fc" in fold(both).skipped
    validate(both, apply(FoldNormGains()), FP32_TOL)  # folds norm_before_fc's gain, keeps fc_norm's


def test_fold_fc_norm_preconditions(checkpoints):
    models = load_pair(checkpoints, "llama", "drafter3.1")
    assert FoldFcNormIntoTarget()(EagleModels(None, models.drafter)).skipped.startswith("no target")
    assert FoldFcNorm()(EagleModels(models.target, None)).skipped == "no drafter"
    moved = FoldFcNormIntoTarget()(copy.deepcopy(models)).model
    assert "already moved" in FoldFcNorm()(moved).skipped
    folded = FoldFcNorm()(copy.deepcopy(models))
    assert folded.changes == {"tensors_rewritten": 1, "params_removed": 3 * 64, "bytes_saved": 3 * 64 * 4}
    # moving after an in-drafter fold still works and stays exact
    validate(folded.model, apply(FoldFcNormIntoTarget()), FP32_TOL, skip=("aux",))


def test_apply_draft_vocab(checkpoints):
    models = load_pair(checkpoints, "llama", "drafter3.1")
    result = ApplyDraftVocab()(copy.deepcopy(models))
    d = result.model.drafter
    assert not hasattr(d, "t2d") and not hasattr(d, "d2t")
    assert result.changes["bytes_saved"] == 320  # t2d: one bool per target token
    assert torch.equal(d.draft_to_target, torch.arange(96) + models.drafter.d2t)
    identity = load_pair(checkpoints, "llama", "drafter_identity")
    assert ApplyDraftVocab()(identity).skipped.startswith("the draft vocabulary is the target's")


def test_share_embeddings(checkpoints):
    models = load_pair(checkpoints, "llama", "drafter_own")
    assert models.drafter.owns_embeddings
    assert "differs from the target's" in ShareEmbeddings()(models).skipped
    with torch.no_grad():  # a drafter carrying an exact copy of the target's table
        models.drafter.embed_tokens.weight.copy_(models.target.embed_tokens.weight)
    before = models.stats()["parameters"]
    rewritten, _ = validate(models, apply(ShareEmbeddings()), 0.0)
    assert rewritten.drafter.embed_tokens.weight is rewritten.target.embed_tokens.weight
    assert before - rewritten.stats()["parameters"] == 320 * 64
    assert ShareEmbeddings()(EagleModels(None, models.drafter)).skipped == "needs both the target and the drafter"


def test_exported_target_graph_loses_gain_multiplies_and_matmuls(checkpoints, tmp_path):
    import collections

    import onnx

    from eagle_export.export.export import export_target

    models = load_pair(checkpoints, "llama", "drafter3.1")
    result = model_pipeline("target")(copy.deepcopy(models))
    ops = {}
    for name, target in (("before", models.target), ("after", result.model.target)):
        export_target(target, tmp_path / f"{name}.onnx", return_logits=False)
        ops[name] = collections.Counter(n.op_type for n in onnx.load(str(tmp_path / f"{name}.onnx")).graph.node)
    folded = {r.name: r for r in result.records}["fold_norm_gains"].changes["norms_folded"] - 3  # 3 in the drafter
    assert ops["before"]["Mul"] - ops["after"]["Mul"] == folded == 13  # 6 layers x 2 + the final norm
    assert ops["before"]["MatMul"] - ops["after"]["MatMul"] == 6 * 3  # q/k/v -> 1 and gate/up -> 1 per layer
    # the aux normalization moved into the target costs no node: the exported graph shares it with
    # the (now gain-free, same eps) input normalization of the layer the aux state enters
    assert ops["after"]["Pow"] == ops["before"]["Pow"]


def test_pipeline_without_target_folds_fc_norm_in_the_drafter(checkpoints):
    models = load_pair(checkpoints, "llama", "drafter3.1")
    result = model_pipeline("target")(EagleModels(None, models.drafter))
    records = {r.name: r for r in result.records}
    assert records["fold_fc_norm_into_target"].skipped.startswith("no target")
    assert records["fold_fc_norm"].modified and all(n.weight is None for n in result.model.drafter.fc_norm)
    with pytest.raises(EagleExportError, match="placement"):
        model_pipeline("somewhere")


def test_registry_lists_both_levels():
    infos = all_passes()
    names = [p.name for p in infos]
    assert names[:7] == ["share_embeddings", "fold_fc_norm", "fold_fc_norm_into_target", "fold_norm_gains",
                         "fuse_qkv", "fuse_gate_up", "apply_draft_vocab"]
    assert {p.level for p in infos} == {"model", "onnx"} and all(p.summary for p in infos)
    assert len(set(names)) == len(names)
    # The list is explicit: every named pass defined in the package must be on it.
    import importlib
    import inspect
    import pkgutil

    import eagle_export.passes as package
    from eagle_export.passes import PassBase

    defined = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"eagle_export.passes.{info.name}")
        defined |= {cls.name for _, cls in inspect.getmembers(module, inspect.isclass)
                    if issubclass(cls, PassBase) and cls.__module__ == module.__name__ and cls.name}
    assert defined == set(names)


def test_cli_lists_passes():
    from click.testing import CliRunner

    from eagle_export.cli import main

    result = CliRunner().invoke(main, ["passes"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == len(all_passes())
    assert lines[0].split()[:2] == ["model", "share_embeddings"]


@pytest.mark.sample
@pytest.mark.slow
def test_pipeline_on_sample_target(sample_target, tmp_path):
    """The real 30-layer target has outlier activations, so fp32 itself is only ~6e-5 accurate on
    its logits (against fp64) and any re-association shows at that level: the rewrite is checked
    exact in fp64 (<= 1e-5), and in fp32 to add no more than twice fp32's own error."""
    drafter_dir = write_tiny_drafter(tmp_path / "drafter", "3.1", seed=0, target_hidden=576, vocab=49152,
                                     draft_vocab=8192, aux=(2, 15, 27), num_attention_heads=9,
                                     num_key_value_heads=3, intermediate_size=1536)
    target = load_target(sample_target, aux_layer_ids=(2, 15, 27))
    models = EagleModels(target, load_drafter(drafter_dir, target=target))
    stats_before = models.stats()
    before = run_pair(models)
    rewritten = model_pipeline()(copy.deepcopy(models)).model
    moved = ("aux",)  # the default placement moves the aux normalization into the target
    fp32_error = max(relative_errors(before, run_pair(rewritten), moved).values())
    stats_after = rewritten.stats()
    del rewritten
    models.target.double(), models.drafter.double()
    fp32_own_error = max(relative_errors(run_pair(models), _cast(before, torch.float64)).values())
    _, fp64_errors = validate(models, lambda m: model_pipeline()(m).model, 1e-5, moved)
    print(f"\nsample pair before {stats_before} after {stats_after}; max relative error: fp32 {fp32_error:.2e} "
          f"(fp32's own vs fp64 {fp32_own_error:.2e}), fp64 {max(fp64_errors.values()):.2e}")
    assert fp32_error <= 2 * fp32_own_error
    assert stats_after["parameters"] < stats_before["parameters"]
    assert stats_after["modules"] < stats_before["modules"]
