"""samples/train_drafter.py's self-distillation generator: batched, ragged greedy decoding with aux capture."""

import sys
from pathlib import Path

import torch

from eagle_export.checkpoint import load_target
from tiny_models import write_tiny_target

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "samples"))
from train_drafter import greedy_batch  # noqa: E402


@torch.no_grad()
def test_greedy_batch_equals_batch_one_greedy_and_a_full_forward(tmp_path):
    target = load_target(write_tiny_target(tmp_path / "t", "llama"), aux_layer_ids=(0, 1)).eval()
    prompts = [[5, 9, 13], [7, 3, 22, 41, 8, 19, 30], [11, 2]]  # ragged on purpose
    # An EOS the tiny model emits early for some prompt, so finished sequences ride along.
    eos = target.generate_greedy(prompts[0], 3)[2]
    for prompt, (tokens, aux, greedy) in zip(prompts, greedy_batch(target, prompts, 10, eos)):
        expected = target.generate_greedy(prompt, 10, eos_ids=(eos,))
        assert tokens[:len(prompt)] == prompt
        assert tokens[len(prompt):] + [int(greedy[-1])] == expected  # the last token is never fed
        k, v = target.empty_cache(1, 0)
        logits, full_aux, _, _ = target(torch.tensor([tokens]), torch.arange(len(tokens))[None], k, v,
                                        torch.tensor([0]))
        assert torch.allclose(torch.from_numpy(aux), full_aux[0], atol=1e-5)
        assert logits[0].argmax(-1).tolist() == greedy.tolist()
