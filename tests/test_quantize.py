"""Quantization with ModelOpt (FP8, NVFP4, weight-only) and the quantized ONNX graphs, on CPU.

FP8 graphs run in ONNX Runtime against ModelOpt's torch fake quantization; NVFP4 graphs run in
onnx.reference (with the TRT_FP4DynamicQuantize reference kernel) against the packed NVFP4 model.
"""

import copy
from collections import Counter

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from tiny_models import write_tiny_drafter, write_tiny_target

from eagle_export.data.prompts import ChatTemplate, chat_prompts
from eagle_export.errors import EagleExportError
from eagle_export.export import loader
from eagle_export.export.export import EXAMPLE_SIZES, export_drafter, export_target
from eagle_export.export.unrolled import TargetGraph, UnrolledDrafter
from eagle_export.models import contract as C
from eagle_export.models.checkpoint import load_drafter, load_target
from eagle_export.models.nvfp4 import NVFP4Linear, use_graph_weights
from eagle_export.quantize import quantize as Q
from eagle_export.runtime.backends import ort_session, run_graph, run_onnx
from eagle_export.speculation.eager import speculative_generate
from eagle_export.speculation.stats import mean_accepted_length
from eagle_export.speculation.tree import TreeShape

pytestmark = pytest.mark.usefixtures("no_grad")
DEPTH = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("q")
    target = load_target(write_tiny_target(root / "t", "llama", num_hidden_layers=3), aux_layer_ids=(0, 1, 2))
    drafter = load_drafter(write_tiny_drafter(root / "d", "3.1", aux=(0, 1, 2)), target=target)
    return target.eval(), drafter.eval(), Q.random_prompts(320, count=2, length=16)


def quantized_pair(models, precision):
    target, drafter, prompts = models
    qtarget = Q.quantize(copy.deepcopy(target), precision, Q.target_calibration_batches(target, prompts))
    qdrafter = copy.deepcopy(drafter)
    qdrafter.share_embeddings(drafter.embed_tokens)
    Q.quantize(qdrafter, precision, Q.drafter_calibration_batches(target, prompts))
    return qtarget, qdrafter


@pytest.fixture(scope="module")
def fp8(models):
    return quantized_pair(models, "fp8")


@pytest.fixture(scope="module")
def nvfp4(models):
    return quantized_pair(models, "nvfp4")


def random_args(spec, tokens):
    return C.example_args(spec, {**EXAMPLE_SIZES, C.TOKENS: tokens}, torch.Generator().manual_seed(0))


def ops(model):
    return Counter((n.domain, n.op_type) for n in model.graph.node)


def initializer_types(model):
    return Counter(t.data_type for t in model.graph.initializer)


def test_config_excludes_lm_head_and_fc_but_not_fc_norm(models, fp8):
    qtarget, qdrafter = fp8
    assert qdrafter.midlayer.self_attn.q_proj.weight_quantizer.is_enabled
    assert qdrafter.midlayer.mlp.down_proj.input_quantizer.is_enabled
    assert not qdrafter.fc.weight_quantizer.is_enabled and not qdrafter.lm_head.weight_quantizer.is_enabled
    assert not qtarget.lm_head.weight_quantizer.is_enabled
    assert qtarget.layers[2].mlp.up_proj.input_quantizer.amax > 0  # calibrated on the prompts
    quantized_fc = Q.quant_config("fp8", exclude=("lm_head",))["quant_cfg"]
    assert not any(e.get("quantizer_name", "").endswith("fc.*") for e in quantized_fc)
    with pytest.raises(EagleExportError, match="unknown precision"):
        Q.quant_config("int3")


def test_nvfp4_through_modelopt_fake_quant_needs_cuda(models):
    target, _, prompts = models
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the ModelOpt path is available")
    with pytest.raises(EagleExportError) as err:
        Q.quantize(copy.deepcopy(target), "nvfp4", Q.target_calibration_batches(target, prompts), fake_quant="modelopt")
    assert "CUDA" in err.value.problem and "packed" in err.value.fix


def test_fp8_target_graph_is_native_qdq_and_matches_torch_in_onnxruntime(tmp_path, fp8):
    qtarget, _ = fp8
    path = tmp_path / "target_fp8.onnx"
    report = export_target(qtarget, path, True, quantized=True)
    model = onnx.load(path)
    counts = ops(model)
    assert not any(domain == "trt" for domain, _ in counts)  # ModelOpt's TRT_FP8 custom ops are gone
    fp8_weights = {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT8E4M3FN}
    assert report["fp8_weights"] == 3 * 7 and len(fp8_weights) == 3 * 7 + 1  # + the zero point
    weight_dqs = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in fp8_weights]
    assert len(weight_dqs) == 3 * 7
    # One Q per activation: q/k/v (and gate/up) read the same input with the same scale, shared after CSE.
    assert 3 * 4 <= counts[("", "QuantizeLinear")] <= 3 * 7
    assert counts[("", "DequantizeLinear")] == counts[("", "QuantizeLinear")] + 3 * 7
    zero_points = {n.input[2] for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")}
    assert len(zero_points) == 1 and not numpy_helper.to_array(
        next(t for t in model.graph.initializer if t.name in zero_points)).astype(np.float32).any()
    assert report["lint_findings"] == []

    spec = C.target_graph(qtarget.config, 3, True)
    args = random_args(spec, 5)
    expected = dict(zip(spec.output_names, TargetGraph(qtarget, True)(*args)))
    got = run_onnx(ort_session(path), spec.feeds(args))
    assert torch.equal(got["greedy_ids"], expected["greedy_ids"])
    for name in ("logits", "aux_hidden", "new_key", "new_value"):
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5)


def test_fp8_drafter_graph_matches_torch_in_onnxruntime(tmp_path, fp8):
    _, qdrafter = fp8
    path = tmp_path / "drafter_fp8.onnx"
    report = export_drafter(qdrafter, DEPTH, False, path, quantized=True)
    assert report["fp8_weights"] == 7 and report["lint_findings"] == []  # fc and lm_head stay fp32
    spec = C.drafter_graph(qdrafter.config, TreeShape.chain(DEPTH), sampling=False)
    args = random_args(spec, DEPTH + 1)
    expected = dict(zip(spec.output_names, UnrolledDrafter(qdrafter, DEPTH, False)(*args)))
    got = run_onnx(ort_session(path), spec.feeds(args))
    assert torch.equal(got["draft_ids"], expected["draft_ids"])
    for name in ("draft_token_probs", "new_key", "new_value"):
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5)


def test_nvfp4_target_graph_is_trt_form_and_matches_packed_torch(tmp_path, nvfp4):
    qtarget, _ = nvfp4
    assert isinstance(qtarget.layers[0].self_attn.q_proj, NVFP4Linear)
    path = tmp_path / "target_nvfp4.onnx"
    report = export_target(qtarget, path, True, quantized=True)
    model = onnx.load(path)
    counts = ops(model)
    activations = counts[("trt", "TRT_FP4DynamicQuantize")]
    assert 3 * 4 <= activations <= 3 * 7 and counts[("", "DequantizeLinear")] == 2 * activations + 2 * 3 * 7
    assert ("eagle", "NVFP4Weight") not in counts
    types = initializer_types(model)
    assert types[onnx.TensorProto.FLOAT4E2M1] == 3 * 7 and types[onnx.TensorProto.FLOAT8E4M3FN] == 3 * 7
    blocked = [n for n in model.graph.node if n.op_type == "DequantizeLinear"
               and any(a.name == "block_size" for a in n.attribute)]
    assert all({a.name: a.i for a in n.attribute} == {"axis": -1, "block_size": 16} for n in blocked)
    assert {o.domain: o.version for o in model.opset_import}[""] == 23 and model.ir_version == 10
    assert report["lint_findings"] == []

    spec = C.target_graph(qtarget.config, 3, True)
    args = random_args(spec, 5)
    expected = dict(zip(spec.output_names, TargetGraph(qtarget, True)(*args)))
    got = run_graph(path, spec.feeds(args))
    assert torch.equal(got["greedy_ids"], expected["greedy_ids"])
    for name in ("logits", "aux_hidden", "new_key", "new_value"):
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5)


def test_nvfp4_drafter_graph_matches_packed_torch(tmp_path, nvfp4):
    _, qdrafter = nvfp4
    path = tmp_path / "drafter_nvfp4.onnx"
    report = export_drafter(qdrafter, DEPTH, False, path, quantized=True)
    assert report["nvfp4_weights"] == 7 and report["lint_findings"] == []
    spec = C.drafter_graph(qdrafter.config, TreeShape.chain(DEPTH), sampling=False)
    args = random_args(spec, DEPTH + 1)
    expected = dict(zip(spec.output_names, UnrolledDrafter(qdrafter, DEPTH, False)(*args)))
    got = run_graph(path, spec.feeds(args))
    assert torch.equal(got["draft_ids"], expected["draft_ids"])
    for name in ("draft_token_probs", "new_key", "new_value"):
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5)


def test_nvfp4_weights_read_back_from_the_graph_run_as_the_packed_model(tmp_path, models, nvfp4):
    """use_graph_weights: the torch model over an NVFP4 graph's own codes and scales computes what the
    packed model it was exported from does, bit for bit (the torch backend of an NVFP4 build)."""
    target, _, _ = models
    qtarget, _ = nvfp4
    export_target(qtarget, tmp_path / "t.onnx", True, quantized=True)
    graph = onnx.load(tmp_path / "t.onnx")
    # as initializer deduplication leaves equal scales (the sample target's): read under other names
    for node in graph.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[1].endswith("_f32_scale"):
            node.input[1] = node.input[1].replace("_f32_scale", "_global")
    for tensor in graph.graph.initializer:
        tensor.name = tensor.name.replace("_f32_scale", "_global")
    rebuilt = copy.deepcopy(target)
    assert use_graph_weights(rebuilt, graph, "target") == 3 * 7
    assert isinstance(rebuilt.layers[2].mlp.down_proj, NVFP4Linear)
    spec = C.target_graph(qtarget.config, 3, True)
    args = random_args(spec, 5)
    expected, got = TargetGraph(qtarget, True)(*args), TargetGraph(rebuilt, True)(*args)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.parametrize("precision", ["fp8_weight_only", "nvfp4_weight_only"])
def test_weight_only_graphs_quantize_no_activation(tmp_path, models, precision):
    target, _, prompts = models
    qtarget = Q.quantize(copy.deepcopy(target), precision, Q.target_calibration_batches(target, prompts))
    path = tmp_path / "t.onnx"
    report = export_target(qtarget, path, False, quantized=True)
    counts = ops(onnx.load(path))
    assert counts[("", "QuantizeLinear")] == 0 and counts[("trt", "TRT_FP4DynamicQuantize")] == 0
    assert report["fp8_weights" if precision.startswith("fp8") else "nvfp4_weights"] == 3 * 7
    assert report["lint_findings"] == []


def test_metrics_against_the_unquantized_models(models, fp8, nvfp4):
    target, drafter, prompts = models
    results = {}
    for name, (qtarget, qdrafter) in (("fp8", fp8), ("nvfp4", nvfp4)):
        results[name] = {"target": Q.target_metrics(target, qtarget, prompts),
                         "drafter": Q.drafter_metrics(drafter, qdrafter, target, prompts)}
    for name in results:
        for part in ("target", "drafter"):
            m = results[name][part]
            assert 0 <= m["kl"] < 0.05 and m["top1_agreement"] > 0.5, (name, part, m)
    # FP8 keeps 3 mantissa bits, NVFP4 one: the 4-bit model must be the further one.
    assert results["fp8"]["target"]["kl"] < results["nvfp4"]["target"]["kl"]
    assert Q.target_metrics(target, target, prompts) == {"top1_agreement": 1.0, "kl": 0.0, "positions": 32}


@pytest.mark.sample
@pytest.mark.slow
def test_fp8_sample_target_stays_close_to_fp32(sample_target):
    """SmolLM2-135M-Instruct in FP8, calibrated on ShareGPT, measured on MT-bench prompts."""
    target = load_target(sample_target).eval()
    template = ChatTemplate(sample_target)
    calib = list(chat_prompts(template, "sharegpt", 4, max_tokens=128))
    evals = list(chat_prompts(template, "mt-bench", 3, max_tokens=384))
    qtarget = Q.quantize(copy.deepcopy(target), "fp8", Q.target_calibration_batches(target, calib))
    logits = {target: [], qtarget: []}  # each model's logits as target_metrics computes them (read again below)
    hooks = [m.register_forward_hook(lambda m, args, out: logits[m].append(out[0][0])) for m in logits]
    metrics = Q.target_metrics(target, qtarget, evals)
    for hook in hooks:
        hook.remove()
    # Measured on 6 MT-bench prompts (400 positions): agreement 0.87, KL 0.059 (NVFP4: 0.67, 0.68).
    assert metrics["top1_agreement"] > 0.8 and metrics["kl"] < 0.2, metrics
    # Where the greedy choice changes, it stays among the reference's top 5 next tokens.
    ref, quant = torch.cat(logits[target]), torch.cat(logits[qtarget])
    assert ref.shape[0] == quant.shape[0] == metrics["positions"]  # every position target_metrics measured
    in_top5 = (ref.topk(5, dim=-1).indices == quant.argmax(-1, keepdim=True)).any(-1)
    assert in_top5.float().mean() > 0.95


def test_greedy_continuation_agreement_and_tau(models, fp8):
    target, drafter, prompts = models
    same = Q.greedy_continuation_agreement(target, target, prompts, new_tokens=12)
    assert same["greedy_agreement"] == 1.0 and same["free_running_prefix"] == 1.0
    assert same["continuation_tokens"] == 24 and same["prompts"] == 2
    qtarget, qdrafter = fp8
    quant = Q.greedy_continuation_agreement(target, qtarget, prompts, new_tokens=12)
    assert 0.5 < quant["greedy_agreement"] <= 1.0 and 0.0 <= quant["free_running_prefix"] <= 1.0
    # A broken model (its last layer's MLP zeroed) must show up as disagreement.
    broken = copy.deepcopy(target)
    broken.layers[-1].mlp.down_proj.weight.zero_()
    assert Q.greedy_continuation_agreement(target, broken, prompts, new_tokens=12)["greedy_agreement"] < 0.9
    # tau of a drafter against itself is that drafter's tau; it is >= 1 and <= depth + 1.
    tau = Q.speculative_tau(target, drafter, prompts, 12, DEPTH)
    assert 1.0 <= tau <= DEPTH + 1
    assert Q.speculative_tau(target, drafter, prompts, 12, DEPTH) == tau
    # Replayed from one greedy run per prompt, it is the draft-verify loop's own tau, round for round.
    loop = [speculative_generate(target, drafter, p, 12, DEPTH).accepted for p in prompts]
    assert tau == mean_accepted_length([m for accepted in loop for m in accepted])
    # One run per target serves the continuations and tau alike (the build decodes each prompt once).
    runs = Q.greedy_runs(target, prompts, 12, DEPTH)
    assert Q.speculative_tau(target, drafter, prompts, 12, DEPTH, runs) == tau
    assert Q.greedy_continuation_agreement(target, qtarget, prompts, 12, (runs, Q.greedy_runs(qtarget, prompts, 12,
                                                                                                DEPTH))) == quant


def test_quantize_models_takes_a_bf16_drafter_beside_an_fp32_target(tmp_path):
    """Published drafters are bf16 while the target loads in fp32 here: the pair gets one dtype."""
    from safetensors.torch import load_file, save_file

    target_dir = write_tiny_target(tmp_path / "t", "llama", num_hidden_layers=3)
    drafter_dir = write_tiny_drafter(tmp_path / "d", "3.1", aux=(0, 1, 2))
    for f in drafter_dir.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(f).items()}, f)
    report, _, _ = Q.quantize_models(target_dir, drafter_dir, "fp8", calib_prompts=2, eval_prompts=2)
    assert 0.0 <= report["drafter"]["kl"] and report["drafter"]["positions"] > 0


@pytest.fixture(scope="module")
def fp16_models(tmp_path_factory):
    """The tiny pair at fp16, the base dtype quantized builds get where TensorRT builds the engines."""
    root = tmp_path_factory.mktemp("q16")
    target = load_target(write_tiny_target(root / "t", "llama", num_hidden_layers=3), aux_layer_ids=(0, 1, 2),
                         dtype="fp16")
    drafter = load_drafter(write_tiny_drafter(root / "d", "3.1", aux=(0, 1, 2)), target=target, dtype="fp16")
    return target.eval(), drafter.eval(), Q.random_prompts(320, count=2, length=16)


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_fp16_quantized_graphs_pass_the_trt_lint_and_keep_fp32_global_scales(tmp_path, fp16_models, precision):
    """NVFP4's double DequantizeLinear yields fp32 (its global scale's type): inside an fp16 graph a
    Cast back to fp16 must follow it, or a strongly typed TensorRT network mixes fp32 and fp16
    (before the fix: 34 mixed_precision findings, and the export refused)."""
    qtarget, qdrafter = quantized_pair(fp16_models, precision)
    reports = {"target": export_target(qtarget, tmp_path / "t.onnx", True, quantized=True),
               "drafter": export_drafter(qdrafter, DEPTH, False, tmp_path / "d.onnx", quantized=True)}
    for role, report in reports.items():
        assert report["lint_findings"] == [], role
        model = onnx.load(tmp_path / f"{role[0]}.onnx")
        fp4_dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"
                  and any(a.name == "block_size" for a in n.attribute)]
        assert len(fp4_dq) == (0 if precision == "fp8" else report["nvfp4_weights"] + ops(model)[
            ("trt", "TRT_FP4DynamicQuantize")])
        consumers = {i: n for n in model.graph.node for i in n.input}
        assert all(consumers[n.output[0]].op_type == "Cast" and consumers[n.output[0]].attribute[0].i
                   == onnx.TensorProto.FLOAT16 for n in fp4_dq)
        global_scales = [t for t in model.graph.initializer if t.name.endswith("_f32_scale")]
        assert len(global_scales) == report.get("nvfp4_weights", 0)
        assert all(t.data_type == onnx.TensorProto.FLOAT for t in global_scales)
    if precision == "nvfp4":  # the fp16 graph computes what the packed fp16 torch model does
        spec = C.target_graph(qtarget.config, 3, True)
        args = C.example_args(spec, {**EXAMPLE_SIZES, C.TOKENS: 5}, torch.Generator().manual_seed(0), torch.float16)
        expected = dict(zip(spec.output_names, TargetGraph(qtarget, True)(*args)))
        got = run_graph(tmp_path / "t.onnx", spec.feeds(args))
        assert got["aux_hidden"].dtype == torch.float16
        agree = (got["greedy_ids"] == expected["greedy_ids"]).float().mean().item()
        err = ((got["logits"].float() - expected["logits"].float()).abs().max() / expected["logits"].float().abs().max())
        print(f"fp16 NVFP4 graph vs packed torch: greedy agreement {agree:.4f}, logits rel. error {err:.2e}")
        assert agree >= 0.995 and err < 2e-2, (agree, err)  # validate.TOLERANCE["fp16"]


def test_a_dynamic_per_tensor_activation_scale_is_refused_naming_its_quantizer(models, monkeypatch):
    """A quantizer calibration never reached has no static scale: ModelOpt would compute it at run time
    over the whole activation, making every token depend on the others of its call. Refused at
    quantization (so at build time), naming the quantizer and the fix."""
    target, _, prompts = models
    monkeypatch.setattr(Q, "calibration_step", lambda model, batch: None)  # nothing reaches the quantizers
    with pytest.raises(EagleExportError, match=r"quantizer \S*layers\.0\.\S*input_quantizer has no calibrated "
                                               r"scale.*dynamic per-tensor") as e:
        Q.quantize(copy.deepcopy(target), "fp8", Q.target_calibration_batches(target, prompts))
    assert "calibrate static activation scales" in e.value.fix


@pytest.mark.slow  # 20 s of CPU: calibration, metrics and two exports
def test_quantize_command_exports_and_checks_both_graphs(tmp_path):
    """`quantize -o`: both graphs written and each checked against its quantized module (ids exactly)."""
    import json

    from click.testing import CliRunner

    from eagle_export.cli import main

    target_dir = write_tiny_target(tmp_path / "t", "llama", num_hidden_layers=3)
    drafter_dir = write_tiny_drafter(tmp_path / "d", "3.1", aux=(0, 1, 2))
    result = CliRunner().invoke(main, ["quantize", "--target", str(target_dir), "--draft", str(drafter_dir),
                                       "--precision", "fp8", "--calib-prompts", "2", "--eval-prompts", "2",
                                       "--depth", str(DEPTH), "-o", str(tmp_path / "out"),
                                       "--json", str(tmp_path / "report.json")])
    assert result.exit_code == 0, result.output
    graphs = json.loads((tmp_path / "report.json").read_text())["graphs"]
    assert (tmp_path / "out" / "target.onnx").is_file() and (tmp_path / "out" / "drafter.onnx").is_file()
    assert graphs["target"]["check"]["greedy_ids_equal"] and graphs["drafter"]["check"]["draft_ids_equal"]
    assert graphs["target"]["fp8_weights"] == 3 * 4 and graphs["drafter"]["fp8_weights"] == 4  # qkv, o, gate_up, down
    assert graphs["target"]["check"]["logits_max_abs_diff"] < 1e-3


def test_quantize_models_quantizes_the_pair_a_build_makes(tmp_path):
    """Repro: `quantize` skipped the model passes `build` applies, so it quantized q/k/v (and gate/up)
    as three (two) Linears with a weight scale each, where a build quantizes one fused qkv_proj
    (gate_up_proj) with one scale: its metrics described a model no build makes."""
    target_dir = write_tiny_target(tmp_path / "t", "llama", num_hidden_layers=3)
    drafter_dir = write_tiny_drafter(tmp_path / "d", "3.1", aux=(0, 1, 2))
    _, qtarget, qdrafter = Q.quantize_models(target_dir, drafter_dir, "fp8", calib_prompts=2, eval_prompts=2)

    def weight_scales(model, projections):
        return sorted(name for name, m in model.named_modules()
                      if name.rsplit(".", 1)[-1] in projections and getattr(m, "weight_quantizer", None) is not None
                      and m.weight_quantizer.amax is not None)

    attention = ("q_proj", "k_proj", "v_proj", "qkv_proj")
    mlp = ("gate_proj", "up_proj", "gate_up_proj")
    assert weight_scales(qtarget, attention) == [f"layers.{i}.self_attn.qkv_proj" for i in range(3)]
    assert weight_scales(qtarget, mlp) == [f"layers.{i}.mlp.gate_up_proj" for i in range(3)]
    assert weight_scales(qdrafter, attention) == ["midlayer.self_attn.qkv_proj"]
    assert weight_scales(qdrafter, mlp) == ["midlayer.mlp.gate_up_proj"]
    # the same modules a build quantizes: the pair through build's model passes
    built_target, built_drafter = loader.load_pair(target_dir, drafter_dir, None, passes=loader.passes_skipping(()))
    for quantized, built in ((qtarget, built_target), (qdrafter, built_drafter)):
        linears = {name for name, m in built.named_modules() if isinstance(m, torch.nn.Linear)}
        assert linears == {name for name, m in quantized.named_modules() if isinstance(m, torch.nn.Linear)}
