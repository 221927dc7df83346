"""The torch modules that are exported: the target graph and the depth-K unrolled drafter.

Their inputs and outputs follow `contract.py` name for name and in order.

UnrolledDrafter runs K chain speculation steps in one forward, so one engine launch proposes K
tokens. Step 0 runs all W input rows (the newly accepted tokens, per the EAGLE-3 convention:
token t_{p+1} with the target's aux state a_p at position p); the draft is read at each sequence's
last valid row. Steps 1..K-1 each feed the previous draft token (embedded in the target
vocabulary) and the previous step's feedback state, one row per sequence. Attention sees the valid
cache slots, the valid step-0 rows and every earlier step; the step K/V stay in-graph and are
concatenated there (small), the cache is only read.

The input width W is the `tokens` axis: decoding passes W = K+1 rows (at most K accepted drafts and
the bonus token, padded, with `num_valid`), and the drafter's prefill passes the whole prompt in
one call. `new_key`/`new_value` hold the W step-0 entries, then one per later step; the runtime
writes the first num_valid at cache_len. Under the EAGLE-3 convention the later steps' entries are
never read back (the next call rewrites those positions from the target's aux states), so a
runtime may skip writing them.

Sampling graphs draw each draft by inverse CDF from the given uniform noise: the draft is the
first draft-vocabulary index whose cumulative probability exceeds u (searchsorted, right side),
so the graph is deterministic and testable. `draft_probs[b, k, i]` is the drafter's probability of
draft-vocabulary index i, i.e. of target token i + d2t[i]; every other target token has q = 0.
"""

from __future__ import annotations

import torch
from torch import nn

from . import contract as C
from .drafter import Drafter
from .errors import EagleExportError
from .target import Target

MIN_TEMPERATURE = 1e-5  # a temperature of 0 asks for greedy: the sampling graph treats it as nearly so


def check_depth(depth: int) -> None:
    if not isinstance(depth, int) or not 1 <= depth <= C.MAX_DEPTH:
        raise EagleExportError(f"speculation depth {depth!r} is out of range",
                               f"choose a depth K from 1 to {C.MAX_DEPTH}")


class TargetGraph(nn.Module):
    """Target forward with the greedy argmax fused in, so greedy decoding never moves logits to the host."""

    def __init__(self, target: Target, return_logits: bool):
        super().__init__()
        self.target, self.return_logits = target, return_logits

    def forward(self, input_ids, positions, past_key, past_value, cache_lens):
        logits, aux, new_key, new_value = self.target(input_ids, positions, past_key, past_value, cache_lens)
        greedy_ids = logits.argmax(-1)
        if self.return_logits:
            return greedy_ids, logits, aux, new_key, new_value
        return greedy_ids, aux, new_key, new_value


class UnrolledDrafter(nn.Module):
    def __init__(self, drafter: Drafter, depth: int, sampling: bool):
        super().__init__()
        check_depth(depth)
        if drafter.embed_tokens is None:
            raise EagleExportError("the drafter has no embedding table",
                                   "load it with load_drafter(path, target=target) to share the target's")
        self.drafter, self.depth, self.sampling = drafter, depth, sampling

    def _choose(self, normed, step, temperature, uniform_noise):
        """normed [B,1,H] -> (draft index [B,1], its probability [B,1], the distribution [B,1,Vd]) in fp32."""
        logits = self.drafter.lm_head(normed).float()
        if not self.sampling:
            probs = torch.softmax(logits, dim=-1)
            token = logits.argmax(-1)
        else:
            scale = temperature.float().clamp_min(MIN_TEMPERATURE)
            probs = torch.softmax(logits / scale[:, None, None], dim=-1)
            cdf = torch.cumsum(probs, dim=-1)
            u = uniform_noise[:, step, None, None].float()
            # searchsorted(cdf, u, right=True) clamped to the last index: count the first Vd-1 entries only
            token = (cdf[..., :-1] <= u).sum(-1)
        chosen = torch.arange(probs.shape[-1], device=probs.device) == token[..., None]
        return token, torch.where(chosen, probs, 0).sum(-1), probs

    def forward(self, input_ids, aux_hidden, num_valid, past_key, past_value, cache_lens,
                temperature=None, uniform_noise=None):
        d = self.drafter
        width = input_ids.shape[1]
        past_k, past_v = past_key[0], past_value[0]
        rows = torch.arange(width, device=input_ids.device)
        slots = torch.arange(past_key.shape[3], device=input_ids.device)
        past_ok = slots[None, None, :] < cache_lens[:, None, None]                     # [B,1,S]
        row_valid = rows[None, :] < num_valid[:, None]                                  # [B,W]

        # Step 0: every input row, causal among themselves, padded rows invisible as keys.
        causal = rows[:, None] >= rows[None, :]                                         # [W,W]
        mask = torch.cat([past_ok.expand(-1, width, -1), causal[None] & row_valid[:, None, :]], dim=-1)
        hidden = d.fuse_aux(aux_hidden)
        positions = cache_lens[:, None] + rows[None, :]
        key_pos = torch.cat([slots[None, :].expand(positions.shape[0], -1), positions], dim=-1)  # [B,S+W]
        normed, feedback, keys, values = d.step(input_ids, hidden, positions, past_k, past_v, mask[:, None, None],
                                                key_pos)
        # The last valid row of each sequence, selected by a one-hot sum (exact; plainer to every
        # backend than a gather with a per-sequence index).
        last = (rows[None, :] == (num_valid - 1)[:, None])[:, :, None]                   # [B,W,1]
        normed = torch.where(last, normed, 0).sum(1, keepdim=True)
        feedback = torch.where(last, feedback, 0).sum(1, keepdim=True)

        ids, token_probs, dists = [], [], []
        for step in range(self.depth):
            if step > 0:
                # One row per sequence at position cache_len + num_valid - 1 + step; it sees the valid
                # cache, the valid step-0 rows, the earlier steps and itself.
                positions = (cache_lens + num_valid - 1 + step)[:, None]
                earlier = (cache_lens >= 0)[:, None, None].expand(-1, 1, step)           # all True, [B,1,step]
                mask = torch.cat([past_ok, row_valid[:, None, :], earlier], dim=-1)
                key_pos = torch.cat([key_pos, positions], dim=-1)                        # [B,S+W+step]
                normed, feedback, new_k, new_v = d.step(target_token, feedback, positions, past_k, past_v,
                                                        mask[:, None, None], key_pos, (keys, values))
                keys, values = torch.cat([keys, new_k], dim=2), torch.cat([values, new_v], dim=2)
            token, prob, dist = self._choose(normed, step, temperature, uniform_noise)
            target_token = d.to_target_ids(token)                                       # [B,1]
            ids.append(target_token)
            token_probs.append(prob)
            dists.append(dist)

        outputs = [torch.cat(ids, dim=1), torch.cat(token_probs, dim=1)]
        if self.sampling:
            outputs.append(torch.cat(dists, dim=1))
        return (*outputs, keys[None], values[None])
