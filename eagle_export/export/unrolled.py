"""The torch modules that are exported: the target graph and the depth-K unrolled drafter.

Their inputs and outputs follow `contract.py` name for name and in order.

UnrolledDrafter drafts a whole tree (tree.Speculation: a chain, a static tree or an EAGLE-2 dynamic
tree) in one forward, so one engine launch proposes every node. Step 0 runs all W input rows (the
newly accepted tokens, per the EAGLE-3 convention: token t_{p+1} with the target's aux state a_p at
position p); the root's drafts are read at each sequence's last valid row. Each later step d =
1..depth-1 feeds one row per node with children at depth d (a chain: one row, the previous draft; a
dynamic tree: the top_k candidates of the level, chosen in the graph), its token embedded in the
target vocabulary with its parent step's feedback state. A row attends to the valid cache slots, the
valid step-0 rows and its own ancestors among the earlier step rows (`StaticLevel.step_mask`; a
dynamic tree builds the same mask per sequence); the step K/V stay in-graph and are concatenated
there (small), the cache is only read.

The input width W is the `tokens` axis: decoding passes W <= depth+1 rows (an accepted path and the
bonus token, padded, with `num_valid`), and the drafter's prefill passes the whole prompt in one
call. `new_key`/`new_value` hold the W step-0 entries, then `step_rows` more (K - 1 for a chain);
the runtime writes the first num_valid at cache_len. Under the EAGLE-3 convention the later steps'
entries are never read back (the next call rewrites those positions from the target's aux states),
so a runtime may skip writing them.

Sampling graphs draw each draft by inverse CDF from the given uniform noise: the draft is the
first draft-vocabulary index whose cumulative probability exceeds u (searchsorted, right side),
so the graph is deterministic and testable. `draft_probs[b, k, i]` is the drafter's probability of
draft-vocabulary index i, i.e. of target token i + d2t[i]; every other target token has q = 0.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import EagleExportError
from ..models.drafter import Drafter
from ..models.layers import rope_cos_sin
from ..models.target import Target
from ..speculation.tree import DynamicTree, Speculation, TreeShape, ancestor_mask, as_tree

MIN_TEMPERATURE = 1e-5  # a temperature of 0 asks for greedy: the sampling graph treats it as nearly so
# fp32 resolves a step of log(1 - 1e-3) at scores down to MAX_DEPTH * log(1e-30) = -553
MIN_SCORE_PROB, MAX_SCORE_PROB = 1e-30, 1.0 - 1e-3


def node_log_prob(q: torch.Tensor) -> torch.Tensor:
    """A dynamic tree's ranking key is the sum of these along the path (the log joint probability),
    each factor clamped so that a child scores strictly below its parent (a near-certain draft has
    q = 1.0 in fp32) and stays finite (q = 0): the best N candidates then always hold every chosen
    node's ancestors, however a backend's TopK breaks ties."""
    return q.float().clamp(MIN_SCORE_PROB, MAX_SCORE_PROB).log()


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dim (the first maximal index on ties): the graphs' `argmax`, which
    exact mode (runtime.exact) rebinds to the kernel, ties to the lowest index there too."""
    return logits.argmax(-1)


class TargetGraph(nn.Module):
    """Target forward with the greedy argmax fused in, so greedy decoding never moves logits to the host."""

    argmax = staticmethod(greedy)

    def __init__(self, target: Target, return_logits: bool):
        super().__init__()
        self.target, self.return_logits = target, return_logits

    def forward(self, input_ids, positions, past_key, past_value, cache_lens, tree_mask):
        logits, aux, new_key, new_value = self.target(input_ids, positions, past_key, past_value, cache_lens,
                                                      tree_mask=tree_mask)
        greedy_ids = self.argmax(logits)
        if self.return_logits:
            return greedy_ids, logits, aux, new_key, new_value
        return greedy_ids, aux, new_key, new_value


class StaticLevel:
    """Level d of a static tree, as the graph needs it (index lists, made tensors at trace time).
    nodes: the level's node numbers; slot: each node's parent among the previous level's step rows
    (0 = the root at level 1); rank: which of the parent's top drafts it holds; frontier: positions in
    `nodes` of the nodes with children (the rows of this level's drafter step); step_mask: each
    frontier row's ancestors-or-self among all step rows up to and including this level's."""

    def __init__(self, tree: TreeShape, depth: int, prev_frontier: list[int], step_rows: list[int]):
        has_children = set(tree.parents)
        self.nodes = [i for i, d in enumerate(tree.depths) if d == depth]
        self.slot = [prev_frontier.index(tree.parents[i]) for i in self.nodes]
        self.rank = [tree.ranks[i] for i in self.nodes]
        self.top = max(self.rank) + 1
        self.frontier = [j for j, i in enumerate(self.nodes) if i in has_children]
        self.frontier_nodes = [self.nodes[j] for j in self.frontier]
        rows = step_rows + self.frontier_nodes
        ancestors = ancestor_mask(tree.parent_tensor())
        self.step_mask = [[bool(ancestors[i, j]) for j in rows] for i in self.frontier_nodes]


class UnrolledDrafter(nn.Module):
    argmax = staticmethod(greedy)

    def __init__(self, drafter: Drafter, speculation: int | Speculation, sampling: bool):
        """speculation: what one call proposes (tree.Speculation; a bare int K is a chain, see `as_tree`)."""
        super().__init__()
        self.tree = as_tree(speculation)
        if drafter.embed_tokens is None:
            raise EagleExportError("the drafter has no embedding table",
                                   "load it with load_drafter(path, target=target) to share the target's")
        self.dynamic = isinstance(self.tree, DynamicTree)
        if sampling and not self.tree.can_sample:
            raise EagleExportError("dynamic trees are drafted greedily only",
                                   "sample with a chain or a static tree, or set temperature 0")
        widest = self.tree.top_k if self.dynamic else max(self.tree.ranks) + 1
        if widest > drafter.config.draft_vocab_size:
            raise EagleExportError(f"the tree asks for the top {widest} drafts of a "
                                   f"{drafter.config.draft_vocab_size}-token draft vocabulary",
                                   "use a narrower tree")
        self.drafter, self.sampling = drafter, sampling
        self.levels = [] if self.dynamic else self._static_levels()
        self._constants: dict = {}  # (values, device) -> tensor; see _const

    def _const(self, values, device) -> torch.Tensor:
        """A static tree's index list as a tensor on `device`, made once: a CUDA graph capture may not
        copy from the host, and its warm-up calls make every constant first (an ONNX trace records it
        as a constant either way)."""
        key = (str(values), str(device))
        if key not in self._constants:
            self._constants[key] = torch.tensor(values, device=device)
        return self._constants[key]

    @property
    def depth(self) -> int:
        return self.tree.depth

    @property
    def is_chain(self) -> bool:
        return self.tree.is_chain

    def _static_levels(self) -> list[StaticLevel]:
        levels, frontier, rows = [], [-1], []
        for depth in range(1, self.tree.depth + 1):
            levels.append(StaticLevel(self.tree, depth, frontier, rows))
            frontier = levels[-1].frontier_nodes
            rows = rows + frontier
        return levels

    def _distribution(self, normed, temperature):
        """normed [B,F,H] -> the draft distribution [B,F,Vd] in fp32 (at `temperature` when sampling)."""
        logits = self.drafter.lm_head(normed).float()
        if self.sampling:
            logits = logits / temperature.float().clamp_min(MIN_TEMPERATURE)[:, None, None]
        return logits, torch.softmax(logits, dim=-1)

    def _choose(self, level: StaticLevel, normed, temperature, uniform_noise):
        """A static level's nodes from its parents' states normed [B,F,H] -> (draft index [B,n], its
        probability [B,n], the distribution each node was drawn from [B,n,Vd]) in fp32."""
        logits, probs = self._distribution(normed, temperature)
        one_per_parent = level.slot == list(range(normed.shape[1]))
        if not one_per_parent:
            slot = self._const(level.slot, normed.device)
            logits, probs = logits[:, slot], probs[:, slot]
        if self.sampling:
            noise = uniform_noise[:, level.nodes].float()[..., None]                    # [B,n,1]
            # searchsorted(cdf, u, right=True) clamped to the last index: count the first Vd-1 entries only
            token = (torch.cumsum(probs, dim=-1)[..., :-1] <= noise).sum(-1)
        elif level.top == 1:
            token = self.argmax(logits)
        else:  # node j holds its parent's rank-j draft
            q, index = torch.topk(probs, level.top, dim=-1)                           # [B,n,top]
            pick = self._const(level.rank, normed.device)[None, :, None]
            return index.gather(2, pick.expand(index.shape[0], -1, -1))[..., 0], \
                q.gather(2, pick.expand(q.shape[0], -1, -1))[..., 0], probs
        chosen = torch.arange(probs.shape[-1], device=probs.device) == token[..., None]
        return token, torch.where(chosen, probs, 0).sum(-1), probs

    def _dynamic(self, normed, feedback, run_step):
        """EAGLE-2 (see DynamicTree): level by level, the top_k drafts of each frontier row are
        candidates scored by log joint probability; the level's top_k are the next frontier, run as
        one drafter step. -> (draft indices, parents, token and joint probabilities), each [B,N],
        nodes by descending score (topological), parents -1 for children of the root."""
        k, batch, device = self.tree.top_k, normed.shape[0], normed.device
        ids, probs, scores, joints, parents = [], [], [], [], []
        frontier_number = torch.full((batch, 1), -1, dtype=torch.int64, device=device)  # the root
        frontier_score = torch.zeros(batch, 1, device=device)
        frontier_joint = torch.ones(batch, 1, device=device)
        frontier_mask = None  # [B,F,E]: each frontier row's ancestors-or-self among the step rows
        offset = 0
        for depth in range(1, self.tree.depth + 1):
            q, index = torch.topk(self._distribution(normed, None)[1], k, dim=-1)           # [B,F,k]
            f = q.shape[1]
            slot = torch.arange(f, device=device).repeat_interleave(k)                     # each candidate's parent row
            q, index = q.reshape(batch, f * k), index.reshape(batch, f * k)
            score = frontier_score[:, slot] + node_log_prob(q)
            ids.append(index)
            probs.append(q)
            scores.append(score)
            joints.append(frontier_joint[:, slot] * q)
            parents.append(frontier_number[:, slot])
            if depth == self.tree.depth:
                break
            pick = torch.topk(score, k, dim=-1).indices if f > 1 else \
                torch.arange(k, device=device)[None].expand(batch, -1)                      # [B,k]
            parent_row = pick // k
            own = torch.eye(k, dtype=torch.bool, device=device)[None].expand(batch, -1, -1)
            step_mask = own if frontier_mask is None else torch.cat(
                [frontier_mask.gather(1, parent_row[..., None].expand(-1, -1, frontier_mask.shape[2])), own], dim=-1)
            hidden = feedback.gather(1, parent_row[..., None].expand(-1, -1, feedback.shape[2]))
            normed, feedback = run_step(depth, self.drafter.to_target_ids(index.gather(1, pick)), hidden, step_mask)
            frontier_mask = step_mask
            frontier_number = offset + pick
            frontier_score, frontier_joint = score.gather(1, pick), joints[-1].gather(1, pick)
            offset += f * k
        # The best N candidates, best first: a parent scores strictly above its children, so this
        # order is topological.
        chosen = torch.topk(torch.cat(scores, 1), self.tree.nodes, dim=-1).indices
        ids, probs, joints, parents = (torch.cat(t, 1).gather(1, chosen) for t in (ids, probs, joints, parents))
        same = parents[:, :, None] == chosen[:, None, :]                                   # [B,N,N]
        numbers = torch.arange(1, self.tree.nodes + 1, device=device)
        return ids, torch.where(same, numbers, 0).sum(-1) - 1, probs, joints

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
        root = (num_valid - 1)[:, None]                                                 # [B,1]
        # Every step's positions and RoPE at once: step 0's rows at cache_lens + 0..W-1, then the rows of
        # step j >= 1 (each at depth j) at cache_lens + root + j. Elementwise, so the same values as
        # computed step by step; on a GPU, a few launches a call instead of a few a step.
        steps = torch.arange(1, max(self.depth, 2), device=input_ids.device)            # (one spare at K=1)
        positions = cache_lens[:, None] + torch.cat([rows[None, :].expand(root.shape[0], -1), root + steps], 1)
        cos, sin = rope_cos_sin(positions, d.inv_freq, hidden.dtype)                    # [B,1,W+K-1,D]
        window = d.config.sliding_window is not None  # (only a window reads the keys' positions)
        key_pos = torch.cat([slots[None, :].expand(positions.shape[0], -1), positions[:, :width]], dim=-1) \
            if window else None                                                         # [B,S+W]
        normed, feedback, keys, values = d.step(input_ids, hidden, positions[:, :width], past_k, past_v,
                                                mask[:, None, None], key_pos, cache_lens=cache_lens,
                                                rope=(cos[:, :, :width], sin[:, :, :width]))
        # The last valid row of each sequence, selected by a one-hot sum (exact; plainer to every
        # backend than a gather with a per-sequence index): the root.
        last = (rows[None, :] == root)[:, :, None]                                      # [B,W,1]
        normed = torch.where(last, normed, 0).sum(1, keepdim=True)
        feedback = torch.where(last, feedback, 0).sum(1, keepdim=True)
        if self.is_chain:  # step j's one row sees the cache, the valid step-0 rows and the j step rows to
            # itself: the first S+W+j columns of one mask made once
            every = (cache_lens >= 0)[:, None, None].expand(-1, 1, max(self.depth - 1, 1))
            chain_mask = torch.cat([past_ok, row_valid[:, None, :], every], dim=-1)     # [B,1,S+W+K-1]

        def run_step(depth, tokens, hidden, step_mask):
            """One batched drafter step over F rows at depth `depth`: tokens [B,F] (target ids), hidden
            [B,F,H] (each parent's feedback), step_mask [B,F,E+F] (ancestors-or-self among the step rows;
            None in a chain: `chain_mask`'s columns)."""
            nonlocal keys, values, key_pos
            f, at = tokens.shape[1], slice(width + depth - 1, width + depth)
            if step_mask is None:
                mask = chain_mask[:, :, :past_k.shape[2] + width + depth]
            else:
                mask = torch.cat([past_ok.expand(-1, f, -1), row_valid[:, None, :].expand(-1, f, -1), step_mask], -1)
            if window:
                key_pos = torch.cat([key_pos, positions[:, at].expand(-1, f)], dim=-1)
            out = d.step(tokens, hidden, positions[:, at].expand(-1, f), past_k, past_v, mask[:, None, None], key_pos,
                         (keys, values), cache_lens, rope=(cos[:, :, at].expand(-1, -1, f, -1),
                                                           sin[:, :, at].expand(-1, -1, f, -1)))
            keys, values = out[2], out[3]  # [the earlier steps' | this one's]: the attention's concatenation
            return out[0], out[1]

        if self.dynamic:
            ids, parents, token_probs, joint_probs = self._dynamic(normed, feedback, run_step)
            return d.to_target_ids(ids), parents, token_probs, joint_probs, keys[None], values[None]
        ids, token_probs, joint_probs, dists = [], [], [], []
        joint = None
        for depth, level in enumerate(self.levels, start=1):
            token, prob, dist = self._choose(level, normed, temperature, uniform_noise)
            target_token = d.to_target_ids(token)                                       # [B,n]
            ids.append(target_token)
            token_probs.append(prob)
            dists.append(dist)
            if not self.is_chain:
                joint = prob if joint is None else joint[:, self._const(level.slot, prob.device)] * prob
                joint_probs.append(joint)
            if level.frontier:  # the nodes with children run one step: own token, parent's feedback
                if level.frontier != list(range(len(level.nodes))):
                    frontier = self._const(level.frontier, token.device)
                    target_token, slot = target_token[:, frontier], [level.slot[j] for j in level.frontier]
                else:
                    slot = level.slot
                if slot != list(range(feedback.shape[1])):
                    feedback = feedback[:, self._const(slot, token.device)]
                if self.is_chain:
                    step_mask = None  # (`chain_mask`'s columns)
                else:  # where the level's mask is all True, no constant mask is needed (decided on the Python
                    # lists: a tensor's truth value would stop a trace and sync a CUDA graph capture)
                    every_row = (cache_lens >= 0)[:, None, None]
                    step_mask = every_row.expand(-1, len(level.step_mask), len(level.step_mask[0])) \
                        if all(map(all, level.step_mask)) \
                        else every_row & self._const(level.step_mask, token.device)[None]
                normed, feedback = run_step(depth, target_token, feedback, step_mask)
                if not self.is_chain:
                    joint = joint[:, self._const(level.frontier, joint.device)] \
                        if level.frontier != list(range(len(level.nodes))) else joint

        order = [i for level in self.levels for i in level.nodes]
        outputs = [ids, token_probs] + ([] if self.is_chain else [joint_probs]) + ([dists] if self.sampling else [])
        outputs = [torch.cat(o, dim=1) for o in outputs]
        if order != list(range(len(order))):  # back to the shape's node order
            inverse = self._const(sorted(range(len(order)), key=order.__getitem__), input_ids.device)
            outputs = [o[:, inverse] for o in outputs]
        if not self.is_chain:
            parents = (cache_lens >= 0)[:, None] * self._const(list(self.tree.parents), input_ids.device)[None]
            outputs.insert(1, parents)
        return (*outputs, keys[None], values[None])
