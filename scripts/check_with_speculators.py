"""Read a speculators-format export with the `speculators` package and compare its forward with this project's.

    python scripts/check_with_speculators.py CHECKPOINT TARGET [--prompts N]

Needs `speculators` (not a dependency of this project: it pins transformers and pulls torchvision,
datasets and more; `pip install --no-deps speculators` plus the few modules its import asks for
is enough to read a checkpoint). Its Eagle3DraftModel is loaded with `from_pretrained` (eager
attention, on CPU), run teacher-forced for 2 steps (its training-time-test forward) on the target's
aux states for MT-bench prompts, and its draft logits at steps 0 and 1 are compared with
`reference.parallel_drafts` over this project's loader. Prints the largest logit difference and
the top-1 agreement per step.
"""

import argparse

import torch

from eagle_export.data.prompts import ChatTemplate, chat_prompts
from eagle_export.export.loader import load_pair
from eagle_export.quantize.quantize import drafter_calibration_batches
from eagle_export.speculation.eager import parallel_drafts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("target")
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from importlib.metadata import version

    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(args.checkpoint)
    config.transformer_layer_config._attn_implementation = "eager"
    theirs = Eagle3DraftModel.from_pretrained(args.checkpoint, config=config).float().eval()
    print(f"speculators {version('speculators')}, transformers {version('transformers')}: read",
          {k: getattr(theirs.config, k) for k in ("norm_before_residual", "fc_norm", "norm_output", "norm_before_fc",
                                                   "eagle_aux_hidden_state_layer_ids")})
    target, ours = load_pair(args.target, args.checkpoint, "float32", passes=())  # ours as written, no pass
    captured = []
    theirs.lm_head.register_forward_hook(lambda module, inputs, output: captured.append(output))
    worst, agree, total = [0.0, 0.0], [0, 0], [0, 0]
    with torch.no_grad():
        prompts = list(chat_prompts(ChatTemplate(args.target), "mt-bench", args.prompts))
        for ids, aux in drafter_calibration_batches(target, prompts):
            t = ids.shape[1]
            captured.clear()
            theirs(hidden_states=aux, input_ids=ids, document_ids=torch.zeros(1, t, dtype=torch.long),
                   position_ids=torch.arange(t)[None], ttt_steps=2)
            mine = parallel_drafts(ours, torch.cat([ids, ids[:, -1:]], 1), aux, 2)
            for k in range(2):
                n = t - k  # step k of their teacher-forced forward pads the last k positions
                a, b = captured[k][0, :n], mine[k][0, :n]
                worst[k] = max(worst[k], float((a - b).abs().max()))
                agree[k] += int((a.argmax(-1) == b.argmax(-1)).sum())
                total[k] += n
    for k in range(2):
        print(f"step {k}: max abs logit diff {worst[k]:.3g}, top-1 agreement {agree[k]}/{total[k]}")


if __name__ == "__main__":
    main()
