"""The architecture matrix: every family the loader accepts, in its released config, against transformers.

Per family a tiny random model is written by transformers from the family's released config.json
(every key that changes the function kept: rope type and scaling, theta, eps, biases, tying,
qk-norm, head_dim, sliding window; widths and layers shrunk, context lengths divided by CONTEXT_SHRINK
so the positions that matter fit a tiny test). It is exported to ONNX (fp32) with a random drafter
and run in ONNX Runtime against transformers' own forward on the same weights:
  - a prefill of PREFILL tokens (past the shrunk original_max_position_embeddings of rope-scaled
    configs and past Mistral's shrunk sliding window) and a chunk placed near the end of the
    shrunk context window (positions ~ 0.9 * max_position_embeddings);
  - logits within LOGITS_RTOL of their largest magnitude, greedy ids identical at every position;
  - the lossless loop on the pair (ONNX Runtime backend) equals transformers' greedy generation.
This table is the README's supported-families table; a family added to the loader belongs here.
"""

import pytest
import torch
import transformers
from tiny_models import write_tiny_drafter, write_word_tokenizer

from eagle_export.export.export import export_drafter, export_target
from eagle_export.models import contract as C
from eagle_export.models.checkpoint import load_drafter, load_target
from eagle_export.models.layers import causal_mask
from eagle_export.runtime.backends import OnnxRuntimeBackend, ort_session, run_onnx
from eagle_export.runtime.runtime import GenerationConfig, SpeculativeRuntime

pytestmark = pytest.mark.usefixtures("no_grad", "one_torch_thread")

CONTEXT_SHRINK = 64  # 8192 -> 128 original positions, 131072 -> 2048, Mistral's window 4096 -> 64
PREFILL = 192
LOGITS_RTOL = 1e-5   # fp32 ONNX Runtime vs transformers, relative to the largest logit (measured 1.7e-7 .. 5.1e-7)
VOCAB = 256

# The released config.json of each model (keys that change the function), before shrinking.
RELEASED = {
    "Llama-2-7b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, num_attention_heads=32,
                       num_key_value_heads=32, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096,
                       tie_word_embeddings=False, attention_bias=False),
    "Llama-3.1-8B": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, num_attention_heads=32,
                         num_key_value_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                         tie_word_embeddings=False,
                         rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    "Llama-3.2-1B": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=131072, tie_word_embeddings=True,
                         rope_scaling={"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    "Mistral-7B-v0.1": dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096,
                            num_attention_heads=32, num_key_value_heads=8, rope_theta=10000.0, rms_norm_eps=1e-5,
                            max_position_embeddings=32768, sliding_window=4096, tie_word_embeddings=False),
    "Qwen2.5-0.5B": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896, num_attention_heads=14,
                         num_key_value_heads=2, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
                         sliding_window=32768, use_sliding_window=False, max_window_layers=21, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584, num_attention_heads=28,
                       num_key_value_heads=4, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=131072,
                       sliding_window=131072, use_sliding_window=False, max_window_layers=28, tie_word_embeddings=False),
    "Qwen3-0.6B": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       max_position_embeddings=40960, attention_bias=False, tie_word_embeddings=True,
                       sliding_window=None, use_sliding_window=False, max_window_layers=28),
}


def shrunk(released: dict) -> dict:
    """Widths to 64 (4 heads, heads/kv-heads ratio kept up to 4), 4 layers, vocabulary VOCAB; head_dim
    scaled with hidden/heads (Qwen3's head_dim stays twice hidden/heads); context lengths / CONTEXT_SHRINK."""
    cfg = dict(released)
    heads = 4
    group = min(4, released["num_attention_heads"] // released["num_key_value_heads"])
    natural = released["hidden_size"] // released["num_attention_heads"]
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=heads,
               num_key_value_heads=heads // group, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
               head_dim=16 * released.get("head_dim", natural) // natural)
    for key in ("max_position_embeddings", "sliding_window"):
        if cfg.get(key):
            cfg[key] //= CONTEXT_SHRINK
    if cfg.get("max_window_layers"):
        cfg["max_window_layers"] = cfg["num_hidden_layers"]
    if "rope_scaling" in cfg:
        scaling = dict(cfg["rope_scaling"])
        scaling["original_max_position_embeddings"] //= CONTEXT_SHRINK
        cfg["rope_scaling"] = scaling
    return cfg


def write_family(path, name: str, seed: int = 0):
    cfg = shrunk(RELEASED[name])
    config = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norm gains (q/k norms included), larger biases: a dropped one shows
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif param_name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(path)
    write_word_tokenizer(path, VOCAB)
    return cfg


@pytest.fixture(scope="module", params=sorted(RELEASED))
def family(request, tmp_path_factory):
    """(name, shrunk config, transformers model, our target, target.onnx session, drafter dir)."""
    root = tmp_path_factory.mktemp(request.param)
    cfg = write_family(root / "target", request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    target = load_target(root / "target", aux_layer_ids=(1, 2, 3))
    export_target(target, root / "target.onnx", return_logits=True)
    return request.param, cfg, hf, target, root


def released_shape_kept(name, cfg, target):
    """The loader read the family's distinguishing keys as transformers did."""
    t = target.config
    assert t.head_dim == cfg["head_dim"] and t.tie_word_embeddings == cfg["tie_word_embeddings"], name
    assert t.qk_norm == (cfg["model_type"] == "qwen3") and t.attention_bias == (cfg["model_type"] == "qwen2")
    assert t.rope.rope_type == cfg.get("rope_scaling", {}).get("rope_type", "default")
    assert t.sliding_window == (cfg["sliding_window"] if cfg["model_type"] == "mistral" else None)


@pytest.mark.parametrize("start", [0, "far"])
def test_onnx_logits_and_greedy_ids_match_transformers(family, start):
    """A PREFILL-token prefill from position 0, and one placed near the end of the context window."""
    name, cfg, hf, target, root = family
    released_shape_kept(name, cfg, target)
    first = 0 if start == 0 else int(0.9 * cfg["max_position_embeddings"]) - PREFILL
    scaling = cfg.get("rope_scaling")
    if scaling:  # positions past the original window, where llama3 scaling changes the angles
        assert first + PREFILL > scaling["original_max_position_embeddings"]
    if cfg.get("sliding_window") and cfg["model_type"] == "mistral":
        assert PREFILL > 2 * cfg["sliding_window"]
    ids = torch.randint(3, VOCAB, (1, PREFILL), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(first, first + PREFILL)[None]
    expected = hf(ids, position_ids=positions).logits
    spec = C.target_graph(target.config, 3, True)
    empty = torch.zeros(cfg["num_hidden_layers"], 1, cfg["num_key_value_heads"], 0, cfg["head_dim"])
    got = run_onnx(ort_session(root / "target.onnx"),
                   spec.feeds((ids, positions, empty, empty, torch.tensor([0]), causal_mask(1, PREFILL))))
    error = float((got["logits"] - expected).abs().max() / expected.abs().max())
    assert error <= LOGITS_RTOL, (name, error)
    assert torch.equal(got["greedy_ids"], expected.argmax(-1)), name


def test_lossless_loop_equals_transformers_greedy(family, tmp_path):
    """The speculative loop on ONNX Runtime (a random drafter, and one whose single draft token is the
    target's most frequent output, so whole drafts get accepted) gives transformers' greedy tokens."""
    name, cfg, hf, target, root = family
    prompts = [[5, 17, 33, 101, 7, 9], [200, 3, 44]]
    new = 40
    expected = [hf.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    frequent = max(set(sum(expected, [])), key=sum(expected, []).count)
    for draft_vocab in (96, 1):
        drafter_dir = write_tiny_drafter(tmp_path / f"d{draft_vocab}", "3", seed=3, vocab=VOCAB,
                                         draft_vocab=draft_vocab, aux=(1, 2, 3))
        drafter = load_drafter(drafter_dir, target=target)
        if draft_vocab == 1:
            drafter.d2t[0] = frequent
        export_drafter(drafter, 3, False, tmp_path / f"drafter{draft_vocab}.onnx")
        backend = OnnxRuntimeBackend(root / "target.onnx", tmp_path / f"drafter{draft_vocab}.onnx")
        runtime = SpeculativeRuntime.for_models(backend, target, drafter, max_context=128, verify_policy="fixed")
        results = runtime.generate(prompts, GenerationConfig(max_new_tokens=new))
        assert [r.tokens for r in results] == expected, (name, draft_vocab)


# ---------------------------------------------------------------- what the loader refuses, by name

@pytest.mark.parametrize("architecture,why", [("Gemma2ForCausalLM", "GeGLU"), ("Phi3ForCausalLM", "longrope"),
                                              ("MixtralForCausalLM", "mixture-of-experts"),
                                              ("Qwen3MoeForCausalLM", "mixture-of-experts"),
                                              ("DeepseekV3ForCausalLM", "MLA"), ("GPTNeoXForCausalLM", "")])
def test_an_unsupported_family_is_refused_with_the_supported_list(tmp_path, architecture, why):
    from eagle_export.errors import CheckpointError
    from eagle_export.models.config import TargetConfig

    cfg = {**shrunk(RELEASED["Llama-2-7b"]), "architectures": [architecture]}
    with pytest.raises(CheckpointError, match=f"unsupported architecture {architecture}.*{why}") as e:
        TargetConfig.from_hf(cfg, where="m")
    for family in ("Llama 2/3.x", "Mistral", "Qwen2/2.5", "Qwen3"):
        assert family in e.value.fix


@pytest.mark.parametrize("edit,field", [({"num_hidden_layers": 6}, "num_hidden_layers: config.json says 6, the weights hold 4"),
                                        ({"head_dim": 16}, "head_dim: config.json says 16, the weights hold 32"),
                                        ({"num_key_value_heads": 4}, "num_key_value_heads x head_dim"),
                                        ({"intermediate_size": 256}, "intermediate_size"),
                                        ({"hidden_size": 96}, "hidden_size")])
def test_config_and_weights_that_disagree_name_the_field(tmp_path, edit, field):
    import json

    from eagle_export.errors import CheckpointError

    write_family(tmp_path, "Qwen3-0.6B")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(CheckpointError, match="config.json and the weights disagree on " + field.replace("(", r"\(")) as e:
        load_target(tmp_path)
    assert "config.json released with these weights" in e.value.fix
