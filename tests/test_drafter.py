"""The drafter: config-driven variants, every key naming in use, vLLM-layout saving."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import tiny_drafter_config, write_tiny_drafter, write_tiny_target

from eagle_export.models.checkpoint import load_drafter, load_state_dict, load_target, save_drafter
from eagle_export.models.config import DrafterConfig, TargetConfig
from eagle_export.models.layers import rms_normalize

pytestmark = pytest.mark.usefixtures("no_grad")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(write_tiny_target(tmp_path_factory.mktemp("t"), "llama"), aux_layer_ids=(1, 3, 4))


def run_steps(drafter, target, ids, steps=3):
    """Step 0 on target aux states, then `steps` feedback steps: the drafter's whole behaviour."""
    b, t = ids.shape
    k, v = target.empty_cache(b, 0)
    _, aux, _, _ = target(ids, torch.arange(t).expand(b, -1), k, v, torch.zeros(b, dtype=torch.long))
    dk, dv = drafter.empty_cache(b, t + steps)
    x = drafter.fuse_aux(aux)
    logits, hidden, nk, nv = drafter(ids, x, torch.arange(t).expand(b, -1), dk[..., :0, :], dv[..., :0, :],
                                     torch.zeros(b, dtype=torch.long))
    dk[..., :t, :], dv[..., :t, :] = nk, nv
    outs = [logits]
    for s in range(steps):
        tok = drafter.to_target_ids(logits[:, -1:].argmax(-1))
        pos = torch.full((b, 1), t + s)
        logits, hidden, nk, nv = drafter(tok, hidden[:, -1:], pos, dk[..., :t + s, :], dv[..., :t + s, :],
                                         torch.full((b,), t + s))
        dk[..., t + s:t + s + 1, :], dv[..., t + s:t + s + 1, :] = nk, nv
        outs.append(logits)
    return outs


def test_fc_norm_is_per_aux_rmsnorm_before_fc(tmp_path, target):
    drafter = load_drafter(write_tiny_drafter(tmp_path / "d", "3.1"), target=target)
    aux = torch.randn(2, 5, 3 * 64)
    chunks = aux.split(64, -1)
    expected = torch.cat([n.weight * rms_normalize(c, 1e-5) for n, c in zip(drafter.fc_norm, chunks)], -1)
    assert torch.allclose(drafter.fuse_aux(aux), expected @ drafter.fc.weight.T, atol=1e-5)


def test_norm_output_feeds_back_the_normed_state(tmp_path, target):
    d3 = load_drafter(write_tiny_drafter(tmp_path / "a", "3", seed=3), target=target)
    d31 = load_drafter(write_tiny_drafter(tmp_path / "b", "3", seed=3, norm_output=True), target=target)
    ids, x = torch.randint(0, 320, (1, 4)), torch.randn(1, 4, 64)
    k, v = d3.empty_cache(1, 0)
    args = (ids, x, torch.arange(4)[None], k, v, torch.zeros(1, dtype=torch.long))
    logits3, pre, *_ = d3(*args)
    logits31, post, *_ = d31(*args)
    assert torch.equal(logits3, logits31)  # lm_head always sees the normed state
    assert torch.allclose(post, d3.norm(pre)) and not torch.allclose(post, pre)


def test_draft_ids_map_into_the_target_vocabulary(tmp_path, target):
    drafter = load_drafter(write_tiny_drafter(tmp_path / "d", "3"), target=target)
    ids = drafter.to_target_ids(torch.arange(96))
    assert ids.unique().numel() == 96 and ids.max() < 320
    assert drafter.t2d.sum() == 96 and drafter.t2d[ids].all()


@pytest.mark.parametrize("prefix", ["", "model."])
@pytest.mark.parametrize("layer", ["midlayer", "layers.0"])
def test_every_key_naming_loads_the_same_drafter(tmp_path, target, prefix, layer):
    src = write_tiny_drafter(tmp_path / "src", "3.1")
    state = load_file(src / "model.safetensors")
    renamed = {}
    for k, t in state.items():
        k = k.replace("midlayer.", layer + ".") if k.startswith("midlayer.") else k
        renamed[prefix + k] = t
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(renamed, str(dst / "model.safetensors"))
    a, b = load_drafter(src, target=target), load_drafter(dst, target=target)
    ids = torch.randint(0, 320, (2, 6))
    for x, y in zip(run_steps(a, target, ids), run_steps(b, target, ids)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("suffix", [".pt", ".npy"])
def test_d2t_in_a_separate_file(tmp_path, target, suffix):
    import numpy as np

    src = write_tiny_drafter(tmp_path / "d", "3")
    state = load_file(src / "model.safetensors")
    d2t = state.pop("d2t")
    state.pop("t2d")
    save_file(state, str(src / "model.safetensors"))
    if suffix == ".pt":
        torch.save(d2t, src / "d2t.pt")
    else:
        np.save(src / "d2t.npy", d2t.numpy())
    drafter = load_drafter(src, target=target)
    assert torch.equal(drafter.d2t, d2t)
    assert drafter.t2d.sum() == 96  # rebuilt from d2t


@pytest.mark.parametrize("version,own", [("3", False), ("3.1", False), ("3.1", True)])
def test_load_save_load_is_bit_identical(tmp_path, target, version, own):
    src = write_tiny_drafter(tmp_path / "a", version, own_embeddings=own)
    drafter = load_drafter(src, target=None)
    save_drafter(drafter, tmp_path / "b")
    first, second = load_state_dict(src), load_state_dict(tmp_path / "b")
    assert sorted(first) == sorted(second)
    assert all(torch.equal(first[k], second[k]) and first[k].dtype == second[k].dtype for k in first)
    assert json.loads((tmp_path / "b" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    # vLLM's layout: midlayer.* names, no embeddings unless the drafter owns them
    assert any(k.startswith("midlayer.self_attn.q_proj") for k in second)
    assert ("embed_tokens.weight" in second) == own


def test_shared_embeddings_are_the_targets_parameter(tmp_path, target):
    drafter = load_drafter(write_tiny_drafter(tmp_path / "d", "3"), target=target)
    assert drafter.embed_tokens.weight is target.embed_tokens.weight


def test_speculators_nested_config(tmp_path):
    flat = tiny_drafter_config("3.1")
    layer_keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                  "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size")
    nested = {k: v for k, v in flat.items() if k not in layer_keys}
    nested["transformer_layer_config"] = {k: flat[k] for k in layer_keys}
    nested["architectures"] = ["Eagle3Speculator"]
    a, b = DrafterConfig.from_hf(flat), DrafterConfig.from_hf(nested)
    assert (a.hidden_size, a.fc_norm, a.norm_output, a.aux_layer_ids) == (b.hidden_size, b.fc_norm, b.norm_output,
                                                                          b.aux_layer_ids)


def test_torchspec_layer_numbering_shifts_aux_ids():
    target_cfg = TargetConfig.from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                       "intermediate_size": 128, "num_hidden_layers": 6,
                                       "num_attention_heads": 4, "vocab_size": 320})
    vllm = DrafterConfig.from_hf(tiny_drafter_config("3", aux=(1, 2, 3)))
    torchspec = DrafterConfig.from_hf(tiny_drafter_config("3", aux=(1, 2, 3), trained_with="TorchSpec"))
    assert vllm.resolved_aux_layer_ids(target_cfg) == (1, 2, 3)
    assert torchspec.layer_numbering == "torchspec" and "trained_with" in torchspec.layer_numbering_reason
    assert torchspec.resolved_aux_layer_ids(target_cfg) == (2, 3, 4)
    default = DrafterConfig.from_hf({k: v for k, v in tiny_drafter_config("3").items() if k != "eagle_config"})
    assert default.resolved_aux_layer_ids(target_cfg) == (0, 3, 6)  # (0, L//2, L) below 7 layers (not (2, 3, 3))


TARGET_CFG = TargetConfig.from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                                   "num_hidden_layers": 6, "num_attention_heads": 4, "vocab_size": 320})


def without_eagle_config(**extra):
    cfg = {k: v for k, v in tiny_drafter_config("3").items() if k != "eagle_config"}
    return DrafterConfig.from_hf({**cfg, **extra})


@pytest.mark.parametrize("spelling, resolved, numbering", [
    ({"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}, (1, 2, 4), "vllm"),          # speculators, top level
    ({"aux_hidden_state_layer_ids": [1, 2, 4]}, (1, 2, 4), "vllm"),                # speculators' newer name
    ({"target_layer_ids": [0, 1, 3]}, (1, 2, 4), "torchspec"),                     # TorchSpec / Edge-LLM
    ({"eagle_config": {"target_layer_ids": [0, 1, 3]}}, (1, 2, 4), "torchspec"),
    ({"eagle_aux_hidden_state_layer_ids": [0, 1, 3], "layer_numbering": "sglang"}, (1, 2, 4), "torchspec"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 2, 4], "target_layer_ids": [0, 1, 3]}, (1, 2, 4), "vllm"),
    ({"layer_numbering": "torchspec"}, (0, 3, 6), "torchspec"),  # the default ids are vLLM's: never shifted
])
def test_every_aux_id_spelling_names_the_same_layers(spelling, resolved, numbering):
    cfg = without_eagle_config(**spelling)
    assert cfg.resolved_aux_layer_ids(TARGET_CFG) == resolved and cfg.layer_numbering == numbering
    if "target_layer_ids" in json.dumps(spelling) and numbering == "torchspec":
        assert "target_layer_ids" in cfg.layer_numbering_reason and "TorchSpec" in cfg.layer_numbering_reason


def test_aux_id_spellings_that_disagree_are_refused():
    with pytest.raises(Exception, match="name different target layers"):
        without_eagle_config(eagle_aux_hidden_state_layer_ids=[1, 2, 4], target_layer_ids=[1, 2, 4])


def test_older_speculators_spellings_load(tmp_path, target):
    """`transformer_config` (speculators before `transformer_layer_config`), layers.0.* names, the
    training-only verifier_* copies of the target's head, and a missing norm_before_fc gain (ones)."""
    src = write_tiny_drafter(tmp_path / "src", "3")
    flat = json.loads((src / "config.json").read_text())
    layer_keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                  "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size")
    spec = {k: v for k, v in flat.items() if k not in layer_keys and k != "eagle_config"}
    spec.update(architectures=["Eagle3Speculator"], speculators_model_type="eagle3", norm_before_fc=True,
                transformer_config={k: flat[k] for k in layer_keys},
                eagle_aux_hidden_state_layer_ids=flat["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    weights = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
               for k, v in load_file(src / "model.safetensors").items()}
    weights["verifier_lm_head.weight"] = weights["lm_head.weight"].clone()
    weights["verifier_norm.weight"] = weights["norm.weight"].clone()
    (tmp_path / "spec").mkdir()
    (tmp_path / "spec" / "config.json").write_text(json.dumps(spec))
    save_file(weights, tmp_path / "spec" / "model.safetensors")
    drafter = load_drafter(tmp_path / "spec", target=target)
    assert drafter.config.norm_before_fc and torch.equal(drafter.input_norm.weight, torch.ones(3 * 64))
    assert drafter.config.resolved_aux_layer_ids(target.config) == (1, 3, 4)


WINDOW = {"layer_types": ["sliding_attention"], "sliding_window": 4}


def test_a_sliding_window_drafter_sees_only_its_window(tmp_path, target):
    """The last row of a window-4 drafter over 12 rows equals the full-attention drafter over the last 4
    rows (same positions, so the same keys); over all 12 rows the full-attention drafter differs."""
    windowed = load_drafter(write_tiny_drafter(tmp_path / "w", "3.1", **WINDOW), target=target)
    full = load_drafter(write_tiny_drafter(tmp_path / "f", "3.1"), target=target)
    assert windowed.config.sliding_window == 4 and full.config.sliding_window is None
    ids = torch.randint(3, 320, (1, 12), generator=torch.Generator().manual_seed(0))
    k, v = target.empty_cache(1, 0)
    _, aux, _, _ = target(ids, torch.arange(12)[None], k, v, torch.zeros(1, dtype=torch.long))

    def last_logits(drafter, rows):
        dk, dv = drafter.empty_cache(1, 0)
        return drafter(ids[:, rows], drafter.fuse_aux(aux[:, rows]), torch.arange(12)[None, rows], dk, dv,
                       torch.zeros(1, dtype=torch.long))[0][0, -1]

    assert torch.allclose(last_logits(windowed, slice(0, 12)), last_logits(full, slice(8, 12)), atol=1e-5)
    assert not torch.allclose(last_logits(full, slice(0, 12)), last_logits(full, slice(8, 12)), atol=1e-3)


def test_parallel_drafts_equal_the_chain_with_a_sliding_window(tmp_path, target):
    """Training-time test and the decoding chain hide the same keys behind the window, at every step."""
    from eagle_export.speculation.eager import draft_chain, parallel_drafts

    drafter = load_drafter(write_tiny_drafter(tmp_path / "w", "3.1", draft_vocab=320, **WINDOW), target=target)
    ids = torch.randint(3, 320, (1, 20), generator=torch.Generator().manual_seed(1))
    k, v = target.empty_cache(1, 0)
    _, aux, _, _ = target(ids, torch.arange(20)[None], k, v, torch.zeros(1, dtype=torch.long))
    depth, t = 3, 16
    next_ids = ids[:, 1:t + depth]
    logits = parallel_drafts(drafter, next_ids, aux[:, :t], depth)
    for p in (2, 9, 15):
        chain = draft_chain(drafter, next_ids[:, :p + 1], aux[:, :p + 1], depth,
                            choose=lambda lg, k, p=p: next_ids[:, min(p + k + 1, t + depth - 2)])  # teacher-forced
        for k in range(depth):
            assert torch.allclose(chain.logits[0, k], logits[k][0, p], atol=1e-5), (p, k)


def test_window_and_qwen3_layer_configs(tmp_path, target):
    assert without_eagle_config(layer_types=["full_attention"], sliding_window=4096).sliding_window is None
    assert without_eagle_config(use_sliding_window=True, sliding_window=8).sliding_window == 8
    with pytest.raises(Exception, match="sliding_window"):
        without_eagle_config(layer_types=["sliding_attention"])
    # speculators' default layer config is Qwen3's: q/k norm per head, and a window it does not use
    qwen3 = without_eagle_config(model_type="qwen3", layer_types=["full_attention"], sliding_window=4096)
    assert qwen3.qk_norm and qwen3.sliding_window is None
    nested = DrafterConfig.from_hf({"model_type": "speculator_model", "speculators_model_type": "eagle3",
                                    "transformer_layer_config": {**tiny_drafter_config("3"), "model_type": "qwen3"}})
    assert nested.qk_norm
    src = write_tiny_drafter(tmp_path / "llama", "3")
    with pytest.raises(Exception, match="q_norm/k_norm"):  # a Qwen3 config over weights without q/k norm
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3"}))
        load_drafter(src, target=target)


def test_a_qwen3_layer_drafter_applies_its_qk_norms(tmp_path, target):
    drafter_dir = write_tiny_drafter(tmp_path / "q", "3", model_type="qwen3")
    weights = load_file(drafter_dir / "model.safetensors")
    assert "midlayer.self_attn.q_norm.weight" in weights and "midlayer.self_attn.k_norm.weight" in weights
    ids = torch.randint(3, 320, (1, 6), generator=torch.Generator().manual_seed(2))
    before = run_steps(load_drafter(drafter_dir, target=target), target, ids, steps=1)
    weights["midlayer.self_attn.k_norm.weight"] = weights["midlayer.self_attn.k_norm.weight"] * 2.0
    save_file(weights, drafter_dir / "model.safetensors")
    after = run_steps(load_drafter(drafter_dir, target=target), target, ids, steps=1)
    assert not torch.allclose(before[0], after[0], atol=1e-3)
