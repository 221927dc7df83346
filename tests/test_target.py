"""The target model against Hugging Face transformers on the same weights (the oracle)."""

import pytest
import tokenizers
import torch
import transformers
from tiny_models import FAMILIES, write_tiny_target

from eagle_export.models.checkpoint import load_target

pytestmark = pytest.mark.usefixtures("no_grad")


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny_pair(request, tmp_path_factory):
    path = write_tiny_target(tmp_path_factory.mktemp(request.param), request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, hf, load_target(path, aux_layer_ids=(0, 2, 5, 6))


def test_logits_and_aux_match_transformers(tiny_pair):
    family, hf, ours = tiny_pair
    ids = torch.randint(0, 320, (3, 23), generator=torch.Generator().manual_seed(1))
    ref = hf(ids, output_hidden_states=True)
    k, v = ours.empty_cache(3, 0)
    logits, aux, new_k, new_v = ours(ids, torch.arange(23).expand(3, -1), k, v, torch.zeros(3, dtype=torch.long))
    assert (ref.logits - logits).abs().max() <= 1e-4, family
    # aux ids are vLLM's: the state entering layer i is transformers' hidden_states[i];
    # entering layer L (one past the last) is the final pre-norm state, which transformers does not expose.
    expected_aux = torch.cat([ref.hidden_states[i] for i in (0, 2, 5)], dim=-1)
    assert (aux[..., :3 * 64] - expected_aux).abs().max() <= 1e-5
    assert new_k.shape == (6, 3, 2, 23, ours.config.head_dim) and new_v.shape == new_k.shape


def test_cached_decode_equals_full_forward(tiny_pair):
    """Prefill 9 tokens, then feed the rest in ragged chunks through the cache: same logits."""
    _, _, ours = tiny_pair
    ids = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(20).expand(2, -1)
    k, v = ours.empty_cache(2, 20)
    full, *_ = ours(ids, pos, k[..., :0, :], v[..., :0, :], torch.zeros(2, dtype=torch.long))
    length, pieces = 0, []
    for chunk in (9, 1, 4, 6):
        sl = slice(length, length + chunk)
        logits, _, nk, nv = ours(ids[:, sl], pos[:, sl], k[..., :length, :], v[..., :length, :],
                                 torch.full((2,), length))
        k[..., sl, :], v[..., sl, :] = nk, nv
        length += chunk
        pieces.append(logits)
    assert (torch.cat(pieces, 1) - full).abs().max() <= 1e-5


def test_greedy_64_tokens_identical_to_transformers(tiny_pair):
    family, hf, ours = tiny_pair
    prompt = [5, 17, 33, 101, 7]
    assert ours.generate_greedy(prompt, 64) == hf_greedy(hf, prompt, 64), family


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_loads_and_tracks_fp32(tmp_path, dtype):
    path = write_tiny_target(tmp_path / "m", "llama")
    ref, half = load_target(path), load_target(path, dtype=dtype)
    assert half.lm_head.weight.dtype == dtype
    ids = torch.randint(0, 320, (1, 12))
    k, v = half.empty_cache(1, 0)
    out16, *_ = half(ids, torch.arange(12)[None], k, v, torch.zeros(1, dtype=torch.long))
    k, v = ref.empty_cache(1, 0)
    out32, *_ = ref(ids, torch.arange(12)[None], k, v, torch.zeros(1, dtype=torch.long))
    assert out16.dtype == dtype
    assert (out16.float() - out32).abs().max() <= 0.05 * out32.abs().max()


def test_sharded_checkpoint_loads(tmp_path):
    path = write_tiny_target(tmp_path / "one", "qwen2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a, b = load_target(path), load_target(tmp_path / "sharded")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_sliding_window_matches_transformers(tmp_path):
    """Mistral with a window shorter than the sequence: the mask must cut old positions."""
    path = write_tiny_target(tmp_path / "m", "mistral", sliding_window=6)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    ours = load_target(path)
    ids = torch.randint(0, 320, (1, 16))
    k, v = ours.empty_cache(1, 0)
    logits, *_ = ours(ids, torch.arange(16)[None], k, v, torch.zeros(1, dtype=torch.long))
    assert (hf(ids).logits - logits).abs().max() <= 1e-4


@pytest.mark.sample
@pytest.mark.slow
def test_sample_target_matches_transformers(sample_target):
    hf = transformers.AutoModelForCausalLM.from_pretrained(sample_target, dtype=torch.float32).eval()
    ours = load_target(sample_target)
    tokenizer = tokenizers.Tokenizer.from_file(str(sample_target / "tokenizer.json"))
    text = "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n"
    prompt = tokenizer.encode(text).ids
    ids = torch.tensor([prompt])
    k, v = ours.empty_cache(1, 0)
    logits, *_ = ours(ids, torch.arange(len(prompt))[None], k, v, torch.zeros(1, dtype=torch.long))
    diff = (hf(ids).logits - logits).abs().max().item()
    print(f"sample target fp32 logits max abs diff vs transformers: {diff:.3e}")
    assert diff <= 1e-3
    assert ours.generate_greedy(prompt, 64) == hf_greedy(hf, prompt, 64)


@pytest.mark.parametrize("layers", range(1, 41))
def test_default_aux_layer_ids_are_distinct_valid_layers_in_order(layers):
    """Repro: a 2-layer target's default aux ids were [2, 1, -1] (EAGLE-3's (2, L//2, L-3) taken as is):
    out of order, and -1 is no layer, so the drafter got two aux states where its fc takes three.
    From 7 layers the default is EAGLE-3's own (what vLLM and SpecForge assume)."""
    from tiny_models import tiny_target_config

    from eagle_export.models.config import TargetConfig, default_aux_layer_ids
    from eagle_export.models.target import Target

    ids = default_aux_layer_ids(layers)
    assert list(ids) == sorted(set(ids)) and all(0 <= i <= layers for i in ids)
    assert len(ids) == min(3, layers + 1)
    if layers >= 7:
        assert ids == (2, layers // 2, layers - 3)
    if layers in (1, 2, 6):  # the target captures one state per id: the aux width the drafter's fc reads
        target = Target(TargetConfig.from_hf(tiny_target_config("llama", num_hidden_layers=layers), "tiny"))
        ids_in = torch.tensor([[5, 6, 7]])
        k, v = target.empty_cache(1, 0)
        aux = target(ids_in, torch.arange(3)[None], k, v, torch.zeros(1, dtype=torch.int64))[1]
        assert aux.shape[-1] == len(ids) * target.config.hidden_size
