"""export-checkpoint: the drafter out in the vLLM / SGLang / speculators layouts, bf16 and ModelOpt FP8/NVFP4,
loaded back by this project's loader with the same draft logits; and read by transformers' own layers."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import write_tiny_drafter, write_tiny_target

from eagle_export.errors import EagleExportError
from eagle_export.models.checkpoint import load_drafter, load_target
from eagle_export.quantize.quantize import drafter_calibration_batches, random_prompts
from eagle_export.speculation.eager import parallel_drafts
from eagle_export.tools.checkpoint_export import ROUND_TRIP_TOLERANCE, export_checkpoint, round_trip

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = random_prompts(320, 3, 16)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    target = write_tiny_target(root / "target", "llama")
    drafters = {v: write_tiny_drafter(root / f"d{v}", v, torch_dtype="bfloat16") for v in ("3", "3.1")}
    return target, drafters


def export(sources, tmp_path, version, fmt="vllm", precision=None, **kw):
    target, drafters = sources
    out = tmp_path / f"{fmt}-{version}-{precision}"
    summary = export_checkpoint(drafters[version], out, fmt, target=target, precision=precision,
                                calib_prompts=PROMPTS, progress=lambda m: None, **kw)
    return out, summary


def logits(drafter, target, dtype=None):
    """Step-0 and step-1 draft logits of `drafter` on PROMPTS' aux states."""
    target.aux_layer_ids = drafter.config.resolved_aux_layer_ids(target.config)
    out = []
    for ids, aux in drafter_calibration_batches(target, PROMPTS):
        out += parallel_drafts(drafter, torch.cat([ids, ids[:, -1:]], 1), aux.to(dtype or aux.dtype), 2)
    return out


@pytest.mark.parametrize("version", ["3", "3.1"])
@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_bf16_round_trip_is_bit_identical(sources, tmp_path, version, fmt):
    out, summary = export(sources, tmp_path, version, fmt)
    assert summary["precision"] == "bfloat16" and summary["round_trip"]["max_abs_logit_diff"] == 0.0
    target = load_target(sources[0], dtype="bfloat16")
    original = load_drafter(sources[1][version], target=target, dtype="bfloat16")
    loaded = load_drafter(out, target=target, dtype="bfloat16")
    # bf16 weights are written as they were read, so the drafter computes the same bits in bf16 too.
    for a, b in zip(logits(original, target), logits(loaded, target)):
        assert torch.equal(a, b)
    for key in ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual"):
        assert getattr(loaded.config, key) == getattr(original.config, key)
    assert loaded.config.resolved_aux_layer_ids(target.config) == original.config.resolved_aux_layer_ids(target.config)


@pytest.mark.parametrize("version", ["3", "3.1"])
@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_modelopt_round_trip_gives_the_quantized_models_logits(sources, tmp_path, version, precision):
    out, summary = export(sources, tmp_path, version, "vllm", precision)
    assert summary["round_trip"]["max_abs_logit_diff"] <= ROUND_TRIP_TOLERANCE
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == precision.upper()
    assert sorted(qc["ignore"]) == ["fc", "lm_head"]
    assert json.loads((out / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == precision.upper()
    weights = load_file(out / "model.safetensors")
    q = "midlayer.self_attn.q_proj"
    assert weights[f"{q}.weight"].dtype == (torch.float8_e4m3fn if precision == "fp8" else torch.uint8)
    assert weights["fc.weight"].dtype == torch.bfloat16 and weights["lm_head.weight"].dtype == torch.bfloat16
    # q/k/v and gate/up share their scales, so a loader that fuses them need not requantize.
    scale = "weight_scale" if precision == "fp8" else "weight_scale_2"
    for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
        for name in (scale, "input_scale"):
            values = {float(weights[f"midlayer.{m}.{name}"]) for m in group}
            assert len(values) == 1, (group, name, values)
    loaded = load_drafter(out, target=load_target(sources[0]))
    kind = "QuantLinear" if precision == "fp8" else "NVFP4Linear"
    assert type(loaded.midlayer.self_attn.q_proj).__name__ == kind
    for kept in (loaded.fc, loaded.lm_head):  # left in high precision, as the config's ignore list says
        assert getattr(kept, "weight_quantizer", None) is None or not kept.weight_quantizer.is_enabled


def test_the_round_trip_catches_a_wrong_scale(sources, tmp_path):
    out, _ = export(sources, tmp_path, "3.1", "vllm", "fp8")
    target = load_target(sources[0], dtype="float32")
    reference = load_drafter(out, target=target, dtype="float32")
    weights = load_file(out / "model.safetensors")
    target.aux_layer_ids = reference.config.resolved_aux_layer_ids(target.config)
    batches = drafter_calibration_batches(target, PROMPTS)
    weights["midlayer.mlp.down_proj.weight_scale"] *= 1.01
    save_file(weights, out / "model.safetensors")
    with pytest.raises(EagleExportError, match="down_proj.weight_quantizer loads back with amax"):
        round_trip(reference, out, target, batches)



def test_configs_avoid_each_readers_traps(sources, tmp_path):
    vllm3 = json.loads((export(sources, tmp_path, "3")[0] / "config.json").read_text())
    assert "norm_output" not in vllm3 and "fc_norm" not in vllm3  # SpecForge reads norm_output: false wrongly
    assert vllm3["norm_before_residual"] is False and vllm3["layer_numbering"] == "vllm"
    assert vllm3["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert vllm3["eagle_export"]["embeddings"] == "shared with the target (not stored)"
    sglang = json.loads((export(sources, tmp_path, "3.1", "sglang")[0] / "config.json").read_text())
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]  # output of layer i
    assert sglang["layer_numbering"] == "sglang" and sglang["fc_norm"] is True and sglang["norm_output"] is True
    assert sglang["eagle_export"]["aux_layer_ids"] == {"vllm": [1, 3, 4], "sglang": [0, 2, 3]}
    out, _ = export(sources, tmp_path, "3.1", "speculators")
    spec = json.loads((out / "config.json").read_text())
    assert spec["speculators_model_type"] == "eagle3" and spec["architectures"] == ["Eagle3Speculator"]
    assert spec["norm_before_residual"] is False  # vLLM's speculators adapter defaults it to true
    assert spec["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert spec["transformer_layer_config"]["fc_norm"] is True and spec["transformer_layer_config"]["norm_output"]
    assert spec["speculators_config"]["verifier"]["name_or_path"] == str(sources[0])
    weights = load_file(out / "model.safetensors")
    assert "embed_tokens.weight" in weights and "layers.0.hidden_norm.weight" in weights
    assert not any(k.startswith("midlayer.") for k in weights) and "d2t" in weights and "t2d" in weights


def test_speculators_format_refuses_quantization_and_share_refuses_a_different_table(sources, tmp_path):
    with pytest.raises(EagleExportError, match="--format vllm"):
        export(sources, tmp_path, "3", "speculators", "fp8")
    own = write_tiny_drafter(tmp_path / "own", "3", own_embeddings=True)
    with pytest.raises(EagleExportError, match="--embeddings store"):
        export_checkpoint(own, tmp_path / "x", "vllm", target=sources[0], progress=lambda m: None)
    assert not (tmp_path / "x").exists()


@torch.no_grad()
def test_transformers_layers_read_the_vllm_layout_by_key_name(sources, tmp_path):
    """A reader this project did not write: transformers' Llama attention, MLP, RMSNorm and RoPE, built
    from the exported config.json and loaded by the vLLM layout's key names, in an EAGLE-3.1 step 0
    written from the public description (fc over per-aux RMSNorms; cat(norm(embed), norm(x)) into
    q/k/v; residual x; final norm; lm_head over the draft vocabulary; target id = draft id + d2t)."""
    from transformers import AutoConfig
    from transformers.models.llama import modeling_llama as L

    out, _ = export(sources, tmp_path, "3.1", "vllm", "fp32")
    cfg = AutoConfig.from_pretrained(out)
    w = load_file(out / "model.safetensors")

    def linear(name):
        layer = torch.nn.Linear(*reversed(w[name].shape), bias=False)
        layer.weight.copy_(w[name])
        return layer

    def norm(name, size):
        module = L.LlamaRMSNorm(size, eps=cfg.rms_norm_eps)
        module.weight.copy_(w[name])
        return module

    attn = L.LlamaAttention(cfg, layer_idx=0)
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
        setattr(attn, p, linear(f"midlayer.self_attn.{p}.weight"))
    mlp = L.LlamaMLP(cfg)
    for p in ("gate_proj", "up_proj", "down_proj"):
        setattr(mlp, p, linear(f"midlayer.mlp.{p}.weight"))
    rope = L.LlamaRotaryEmbedding(cfg)
    target = load_target(sources[0])
    ids_aux = drafter_calibration_batches(target_with_ids(target, cfg), PROMPTS)
    ours = load_drafter(out, target=target)
    for ids, aux in ids_aux:
        positions = torch.arange(ids.shape[1])[None]
        h = cfg.target_hidden_size
        x = linear("fc.weight")(torch.cat([norm(f"fc_norm.{i}.weight", h)(a)
                                           for i, a in enumerate(aux.split(h, -1))], -1))
        embeds = target.embed_tokens(ids)
        attn_in = torch.cat([norm("midlayer.input_layernorm.weight", cfg.hidden_size)(embeds),
                             norm("midlayer.hidden_norm.weight", cfg.hidden_size)(x)], -1)
        t = ids.shape[1]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        a, _ = attn(attn_in, rope(x, positions), attention_mask=mask)
        x = x + a
        x = x + mlp(norm("midlayer.post_attention_layernorm.weight", cfg.hidden_size)(x))
        theirs = linear("lm_head.weight")(norm("norm.weight", cfg.hidden_size)(x))
        mine = parallel_drafts(ours, torch.cat([ids, ids[:, -1:]], 1), aux, 1)[0]
        assert (theirs - mine).abs().max() < 1e-4
        draft = theirs.argmax(-1)
        assert torch.equal(draft + w["d2t"][draft], ours.to_target_ids(mine.argmax(-1)))


def target_with_ids(target, cfg):
    target.aux_layer_ids = tuple(cfg.eagle_config["eagle_aux_hidden_state_layer_ids"])
    return target


def test_cli_exports_and_reports_the_round_trip(sources, tmp_path):
    from click.testing import CliRunner

    from eagle_export.cli import main

    target, drafters = sources
    out = tmp_path / "spec"
    result = CliRunner().invoke(main, ["export-checkpoint", str(drafters["3.1"]), "--target", str(target), "-o", str(out),
                                       "--format", "speculators", "--verifier", "org/tiny-target"])
    assert result.exit_code == 0, result.output
    assert "embeddings stored" in result.output and "max abs logit diff 0" in result.output
    assert "serve it exactly: speculators 0.9.0 (as-is)" in result.output and "mis-serve" not in result.output
    summary = json.loads((out / "export_summary.json").read_text())
    assert summary["round_trip"]["max_abs_logit_diff"] == 0.0 and summary["embeddings"] == "store"
    assert json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-target"
    again = CliRunner().invoke(main, ["export-checkpoint", str(drafters["3.1"]), "--target", str(target), "-o", str(out)])
    assert again.exit_code == 2 and "already exists" in again.output and "--force" in again.output
    args = [str(drafters["3.1"]), "--target", str(target), "--force", "-o"]
    replaced = CliRunner().invoke(main, ["export-checkpoint", *args, str(out)])  # our own export: replaced
    assert replaced.exit_code == 0, replaced.output
    # EAGLE-3.1 in the vLLM layout: the readers measured to mis-serve it are named, on the terminal and in the config.
    assert "warning: known to mis-serve it: speculators 0.9.0's Eagle3Converter drops fc_norm" in replaced.output
    assert "warning: known to mis-serve it: SpecForge 0.2.0 feeds back the pre-norm state" in replaced.output
    readers = json.loads((out / "config.json").read_text())["eagle_export"]["readers"]
    assert readers["exact"] == [] and len(readers["mis_serve"]) == 3 and "0.9.0" in readers["measured"]
    for theirs in (drafters["3.1"], drafters["3.1"].parent, target):
        refused = CliRunner().invoke(main, ["export-checkpoint", *args, str(theirs)])
        assert refused.exit_code == 2 and "an input of this build" in refused.output, refused.output
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "n.txt").write_text("mine")
    refused = CliRunner().invoke(main, ["export-checkpoint", *args, str(tmp_path / "notes")])
    assert refused.exit_code == 2 and "not a checkpoint written by eagle-export" in refused.output
    assert (tmp_path / "notes" / "n.txt").read_text() == "mine"
    alone = CliRunner().invoke(main, ["export-checkpoint", str(drafters["3.1"]), "-o", str(tmp_path / "x")])
    assert alone.exit_code == 2 and "--target" in alone.output


def test_sliding_window_and_qwen3_layer_drafters_export(sources, tmp_path):
    target, _ = sources
    windowed = write_tiny_drafter(tmp_path / "w", "3.1", layer_types=["sliding_attention"], sliding_window=3)
    qwen3 = write_tiny_drafter(tmp_path / "q", "3", model_type="qwen3")
    for drafter, fmt in ((windowed, "vllm"), (windowed, "speculators"), (qwen3, "speculators")):
        out = tmp_path / f"{drafter.name}-{fmt}"
        summary = export_checkpoint(drafter, out, fmt, target=target, calib_prompts=PROMPTS, progress=lambda m: None)
        assert summary["round_trip"]["max_abs_logit_diff"] == 0.0
        config = json.loads((out / "config.json").read_text())
        layer = config.get("transformer_layer_config", config)
        if drafter == windowed:
            assert layer["layer_types"] == ["sliding_attention"] and layer["sliding_window"] == 3
        else:
            assert layer["model_type"] == "qwen3" and "layers.0.self_attn.q_norm.weight" in load_file(
                out / "model.safetensors")
    with pytest.raises(EagleExportError, match="--format speculators"):
        export_checkpoint(qwen3, tmp_path / "x", "vllm", target=target, progress=lambda m: None)


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_a_rope_scaled_pair_exports_its_scaling_exactly(tmp_path, fmt):
    """A Llama-3.x pair (llama3 rope scaling, short original context so the scaled frequencies turn
    within the prompts): the checkpoint carries the drafter's rope_scaling key for key, and loads back
    with its logits; the same checkpoint with the scaling dropped does not (the case is not vacuous)."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    target = write_tiny_target(tmp_path / "target", "llama3", rope_scaling=dict(scaling))
    drafter = write_tiny_drafter(tmp_path / "drafter", "3", rope_scaling=dict(scaling))
    out = tmp_path / fmt
    summary = export_checkpoint(drafter, out, fmt, target=target, calib_prompts=PROMPTS, progress=lambda m: None)
    assert summary["round_trip"]["max_abs_logit_diff"] == 0.0
    config = json.loads((out / "config.json").read_text())
    layer = config.get("transformer_layer_config", config)
    assert layer["rope_scaling"] == scaling and layer["rope_theta"] == 10000.0
    target_model = load_target(target, dtype="float32")
    original = load_drafter(drafter, target=target_model, dtype="float32")
    loaded = load_drafter(out, target=target_model, dtype="float32")
    assert loaded.config.rope == original.config.rope and original.config.rope.rope_type == "llama3"
    target_model.aux_layer_ids = original.config.resolved_aux_layer_ids(target_model.config)
    batches = drafter_calibration_batches(target_model, PROMPTS)
    assert round_trip(original, out, target_model, batches) == 0.0
    del layer["rope_scaling"]
    (out / "config.json").write_text(json.dumps(config))
    assert round_trip(original, out, target_model, batches) > 100 * ROUND_TRIP_TOLERANCE


def test_reader_notes_follow_the_measured_table():
    from eagle_export.tools.checkpoint_export import reader_notes

    assert reader_notes("speculators", "3.1", None)["mis_serve"] == []
    assert any("without their scales" in line for line in reader_notes("vllm", "3.1", "fp8")["mis_serve"])
    assert reader_notes("sglang", "3", None) == reader_notes("vllm", "3", "bf16")
    assert not reader_notes("vllm", "3", None)["mis_serve"] and reader_notes("vllm", "3", None)["exact"]


def test_nvfp4_notes_speak_of_nvfp4():
    """Repro: an NVFP4 export warned that readers "load the FP8 codes without their scales": what was
    measured is FP8's; for NVFP4 no reader was run, and the note says so (not a mis-serve)."""
    from eagle_export.tools.checkpoint_export import reader_notes

    nvfp4 = reader_notes("vllm", "3.1", "nvfp4")
    assert nvfp4["mis_serve"] == [] and nvfp4["exact"] == []
    assert "no reader was run on an NVFP4 export" in nvfp4["unmeasured"][0]
    assert all("FP8 codes" not in line for line in nvfp4["mis_serve"] + nvfp4["refuse"])
    assert "--precision nvfp4 is refused" in reader_notes("speculators", "3", "nvfp4")["refuse"][0]


def test_cli_names_the_aux_ids_in_the_written_numbering_and_says_what_was_measured(sources, tmp_path):
    """Repro: `--format sglang` printed "aux ids [...] in vLLM numbering" beside a config in SGLang's,
    and "readers measured to serve it exactly: none" read as "nothing serves this"."""
    from click.testing import CliRunner

    from eagle_export.cli import main

    target, drafters = sources  # the drafters' aux ids are (1, 3, 4) in vLLM numbering
    for fmt, written in (("sglang", "[0, 2, 3] in SGLang"), ("vllm", "[1, 3, 4] in vLLM")):
        out = tmp_path / fmt
        result = CliRunner().invoke(main, ["export-checkpoint", str(drafters["3.1"]), "--target", str(target), "-o",
                                           str(out), "--format", fmt])
        assert result.exit_code == 0 and f"aux ids {written} numbering" in result.output, result.output
        ids = json.loads((out / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        assert f"aux ids {ids} " in result.output  # what is printed is what was written
        assert ("measured to serve it exactly: none of the readers run here (speculators 0.9.0, SpecForge 0.2.0"
                in result.output and "vLLM and SGLang were not run here" in result.output)


def test_calib_prompts_are_cut_to_the_calibrations_token_limit(sources, tmp_path, monkeypatch):
    """Repro: `--calib-prompts 32` rendered whole ShareGPT conversations (thousands of tokens; it did not
    finish in 5 minutes); each is cut to the calibration's limit, as the build's own set is."""
    from click.testing import CliRunner

    from eagle_export.cli import main
    from eagle_export.tools import checkpoint_export

    seen = []

    def capture(target, prompts):  # the calibration's first step
        seen.extend(prompts)
        raise EagleExportError("stopped after calibration prompts")

    monkeypatch.setattr(checkpoint_export.Q, "drafter_calibration_batches", capture)
    target, drafters = sources
    result = CliRunner().invoke(main, ["export-checkpoint", str(drafters["3"]), "--target", str(target), "-o",
                                       str(tmp_path / "x"), "--precision", "fp8", "--calib-prompts", "6"])
    assert "stopped after calibration prompts" in result.output
    limit = checkpoint_export.resolve_source(drafters["3"], target)["calibration"]["max_tokens"]
    assert len(seen) == 6 and max(map(len, seen)) == limit  # the cut bites: some conversation is longer


def test_calibration_says_its_steps(sources, tmp_path):
    """Repro: an FP8 export said one line and then nothing until it was done (minutes on long prompts):
    the calibration's steps are said as they finish, with the prompts' token bound."""
    lines = []
    target, drafters = sources
    export_checkpoint(drafters["3.1"], tmp_path / "fp8", "vllm", target=target, precision="fp8",
                      calib_prompts=PROMPTS, progress=lines.append)
    start = next(i for i, line in enumerate(lines) if line.startswith("quantizing the drafter to fp8"))
    assert f"on {len(PROMPTS)} prompts (up to {max(map(len, PROMPTS))} tokens each)" in lines[start]
    assert lines[start + 1].startswith("aux states in ") and lines[start + 2].startswith("calibrated in ")


def test_fp8_export_computes_with_the_amaxes_its_scales_read_back_as(sources, tmp_path, monkeypatch):
    """Regression (the sample build's FP8 export with one torch thread, 0.236 apart): the checkpoint
    stores scale = fl(amax / 448) and the loader reads amax' = fl(scale x 448), which is one ulp off
    for about 9% of fp32 amaxes; the exported model must compute with amax'. Planted here: the
    sample's calibrated q/k/v input amax, which does not survive. Planted bug: no snapping, which the
    round trip's amax check refuses (the tiny model's logits alone do not show it)."""
    from eagle_export.tools import checkpoint_export as ce

    amax = torch.tensor(float.fromhex("0x1.cd5e36p+2"))  # the sample's q/k/v input amax with one thread
    assert not torch.equal((amax / 448.0) * 448.0, amax)
    unify = ce.unify_fused_scales

    def planted(drafter):
        unify(drafter)
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(drafter.midlayer.self_attn, name).input_quantizer.amax = amax.clone()

    monkeypatch.setattr(ce, "unify_fused_scales", planted)
    out, summary = export(sources, tmp_path, "3.1", "vllm", "fp8")
    assert summary["round_trip"]["max_abs_logit_diff"] == 0.0
    scale = load_file(out / "model.safetensors")["midlayer.self_attn.q_proj.input_scale"]
    assert torch.equal(scale.float(), amax / 448.0)  # the written scale is the calibrated amax's
    monkeypatch.setattr(ce, "snap_fp8_amaxes", lambda drafter: None)
    with pytest.raises(EagleExportError, match="q_proj.input_quantizer loads back with amax 7.20887"):
        export(sources, tmp_path / "bug", "3.1", "vllm", "fp8")
    assert not (tmp_path / "bug").exists()
