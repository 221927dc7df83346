"""The reference draft-verify loop in plain PyTorch: batch 1, a chain of K drafts per round.

It is the oracle the exported runtime is checked against, so it is written for obviousness, not
speed. Drafting follows the EAGLE-3 convention (as in vLLM): the drafter input at position p pairs
the target's aux state a_p with the token at p+1 and predicts the token at p+2; speculative steps
feed back the drafter's own hidden state; the drafter cache rolls back by length alone.

Verification is greedy (temperature 0: lossless, the output equals target-only greedy decoding)
or rejection sampling (accept draft d with probability min(1, p(d)/q(d)), else sample from
norm(max(0, p - q))), which preserves the target's sampling distribution.

`draft_chain` runs the drafter's chain in plain single steps (step 0 over the given rows, then
feedback steps), as decoding does: calibration, quantization metrics and the unrolled graph's
test oracle use it. `parallel_drafts` computes, in one pass, the chain the drafter proposes after
every prefix of a known token sequence (training-time test); on a target-greedy sequence it
reproduces the drafts of the loop exactly, which `replay_greedy` uses to score many depths from
one target generation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models.drafter import Drafter
from ..models.target import Target
from .stats import acceptance_by_depth, mean_accepted_length
from .tree import rejection_sample_path


@dataclass
class SpeculativeResult:
    tokens: list[int]
    depth: int
    accepted: list[int] = field(default_factory=list)  # drafts accepted in each round (before truncation)
    drafts: list[list[int]] = field(default_factory=list)  # each round's proposed chain (target ids)

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean tokens per round: accepted drafts plus the bonus token."""
        return mean_accepted_length(self.accepted)

    @property
    def acceptance_by_depth(self) -> list[float]:
        return acceptance_by_depth(self.accepted, self.depth)


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The distribution sampling draws from: softmax(logits / T), optionally cut to the top-p nucleus."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
        sorted_probs = torch.where(before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def rejection_sample(p: torch.Tensor, q: torch.Tensor, drafts: list[int], generator=None) -> tuple[int, int]:
    """p [K+1,V] target probs at each verified position, q [K,V] draft probs (target vocabulary).
    -> (accepted count m, the token that follows the accepted drafts). The chain case of the tree
    rule: each row's one child is the next draft."""
    q_rows = torch.cat([q, q.new_zeros(1, p.shape[-1])])  # the last draft's row has no child
    path, token = rejection_sample_path(p, q_rows, list(drafts), list(range(-1, len(drafts) - 1)), generator)
    return len(path), token


@torch.no_grad()
def speculative_generate(target: Target, drafter: Drafter, prompt_ids: list[int], max_new_tokens: int,
                         depth: int, eos_ids=(), temperature: float = 0.0, top_p: float = 1.0,
                         generator: torch.Generator | None = None) -> SpeculativeResult:
    """Generate up to `max_new_tokens` with chain drafting of `depth` tokens per round."""
    assert depth >= 1 and max_new_tokens >= 1 and len(prompt_ids) >= 1
    greedy = temperature == 0.0
    n = len(prompt_ids)
    capacity = n + max_new_tokens + depth + 1
    tk, tv = target.empty_cache(1, capacity)
    dk, dv = drafter.empty_cache(1, capacity)
    t2d_index = drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size))  # also after apply_draft_vocab

    def run_target(ids: list[int], length: int):
        positions = torch.arange(length, length + len(ids)).unsqueeze(0)
        logits, aux, new_k, new_v = target(torch.tensor([ids]), positions, tk[:, :, :, :length],
                                           tv[:, :, :, :length], torch.tensor([length]))
        tk[:, :, :, length:length + len(ids)] = new_k
        tv[:, :, :, length:length + len(ids)] = new_v
        return logits[0], aux

    def run_drafter(ids: list[int], hidden: torch.Tensor, length: int):
        positions = torch.arange(length, length + len(ids)).unsqueeze(0)
        logits, feedback, new_k, new_v = drafter(torch.tensor([ids]), hidden, positions, dk[:, :, :, :length],
                                                 dv[:, :, :, :length], torch.tensor([length]))
        dk[:, :, :, length:length + len(ids)] = new_k
        dv[:, :, :, length:length + len(ids)] = new_v
        return logits[0, -1], feedback[:, -1:]

    def pick(probs_or_logits: torch.Tensor) -> int:
        if greedy:
            return int(probs_or_logits.argmax())
        return int(torch.multinomial(probs_or_logits, 1, generator=generator))

    logits, aux = run_target(prompt_ids, 0)
    first = pick(logits[-1] if greedy else target_probs(logits[-1], temperature, top_p))
    result = SpeculativeResult(tokens=[first], depth=depth)
    # Drafter inputs not yet in its cache: tokens t_1..t_n with the aux states of t_0..t_{n-1}.
    pending_ids, pending_aux, committed = prompt_ids[1:] + [first], aux, 0
    while len(result.tokens) < max_new_tokens and first not in eos_ids:
        draft_logits, hidden = run_drafter(pending_ids, drafter.fuse_aux(pending_aux), committed)
        drafts, draft_probs = [], []
        for k in range(depth):
            if greedy:
                d = int(drafter.to_target_ids(draft_logits.argmax()))
            else:
                q = torch.zeros(target.config.vocab_size, dtype=torch.float64)
                q[t2d_index] = torch.softmax(draft_logits.double() / temperature, dim=-1)
                d = pick(q)
                draft_probs.append(q)
            drafts.append(d)
            if k + 1 < depth:  # speculative entries go past `length`; the next round overwrites them
                draft_logits, hidden = run_drafter([d], hidden, committed + len(pending_ids) + k)
        length = committed + len(pending_ids)  # the target has run t_0 .. t_{n-1}; t_n comes first now
        verify_logits, verify_aux = run_target([pending_ids[-1]] + drafts, length)
        if greedy:
            targets = verify_logits.argmax(-1).tolist()
            m = next((i for i in range(depth) if drafts[i] != targets[i]), depth)
            bonus = targets[m]
        else:
            p = target_probs(verify_logits, temperature, top_p)
            m, bonus = rejection_sample(p, torch.stack(draft_probs), drafts, generator)
        result.accepted.append(m)
        result.drafts.append(drafts)
        new_tokens = drafts[:m] + [bonus]
        for i, t in enumerate(new_tokens):
            if t in eos_ids:
                new_tokens = new_tokens[:i + 1]
                break
        result.tokens += new_tokens[:max_new_tokens - len(result.tokens)]
        first = result.tokens[-1]
        committed = length  # the drafter keeps its step-0 entries below t_n's position; the rest rolls back
        pending_ids, pending_aux = drafts[:m] + [bonus], verify_aux[:, :m + 1]
        if any(t in eos_ids for t in new_tokens):
            break
    return result


@dataclass
class DraftChain:
    step0_logits: torch.Tensor  # [B,T,Vd]: step 0 at every input row
    logits: torch.Tensor        # [B,K,Vd]: what each draft was chosen from (the last row's, step by step)
    indices: torch.Tensor       # [B,K] the drafts in the draft vocabulary
    drafts: torch.Tensor        # [B,K] the drafts in target ids
    new_key: torch.Tensor       # [1,B,Hkv,T+K-1,D]: the T step-0 entries, then one per later step
    new_value: torch.Tensor


@torch.no_grad()
def draft_chain(drafter: Drafter, ids: torch.Tensor, aux: torch.Tensor, depth: int, past_key=None, past_value=None,
                choose=None) -> DraftChain:
    """The chain of `depth` drafts as decoding proposes it, in plain drafter steps.

    Step 0 runs the rows ids [B,T] (t_{p+1} .. ) with fuse_aux(aux) [B,T,A*Ht] (a_p .. ) at positions
    S..S+T-1 after a cache of S entries (past_key/past_value [1,B,Hkv,S,D], none by default); each
    later step feeds the previous draft and the previous step's feedback state, one row. Draft k
    comes from the last row of step k-1: `choose(logits [B,Vd], k) -> draft-vocabulary indices [B]`,
    argmax by default."""
    b, t = ids.shape
    if past_key is None:
        past_key, past_value = drafter.empty_cache(b, 0, dtype=aux.dtype)
    choose = choose or (lambda logits, k: logits.argmax(-1))
    start = past_key.shape[3]
    logits, hidden, new_k, new_v = drafter(ids, drafter.fuse_aux(aux), start + torch.arange(t).expand(b, t),
                                           past_key, past_value, torch.full((b,), start))
    step0_logits, last, hidden = logits, logits[:, -1], hidden[:, -1:]
    keys, values = torch.cat([past_key, new_k], 3), torch.cat([past_value, new_v], 3)
    chosen, indices, token = [], [], None  # token: the previous step's draft, fed to the next
    for k in range(depth):
        if k > 0:
            length = keys.shape[3]
            logits, hidden, new_k, new_v = drafter(token, hidden, torch.full((b, 1), length), keys, values,
                                                   torch.full((b,), length))
            keys, values = torch.cat([keys, new_k], 3), torch.cat([values, new_v], 3)
            last = logits[:, -1]
        chosen.append(last)
        indices.append(choose(last, k))
        token = drafter.to_target_ids(indices[-1])[:, None]
    indices = torch.stack(indices, 1)
    return DraftChain(step0_logits, torch.stack(chosen, 1), indices, drafter.to_target_ids(indices),
                      keys[..., start:, :], values[..., start:, :])


def parallel_drafts(drafter: Drafter, next_ids: torch.Tensor, aux: torch.Tensor, depth: int,
                    first_chain: int = 0) -> list[torch.Tensor]:
    """Training-time test: the drafter's chain after every prefix, all positions at once.

    aux [B,T,A*Ht] holds a_0..a_{T-1}; next_ids [B,T+depth-1] holds t_1..t_{T+depth-1} (the token
    following each aux state, and `depth-1` more). Step k of the chain started at position p
    consumes next_ids[p+k] at position p+k and attends to the step-0 keys at 0..p and its own keys
    of steps 1..k, exactly the drafter cache of the loop. Only the chains at positions
    first_chain..T-1 are computed past step 0. -> logits of each step, [B,T-first_chain,Vd] each;
    step k of the chain at p predicts t_{p+k+2}."""
    b, t = aux.shape[:2]
    n = t - first_chain
    hidden = drafter.fuse_aux(aux)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    own = torch.eye(n, dtype=torch.bool)
    keys, values, out = [], [], []
    key_pos = torch.arange(t)  # the step-0 keys, then each later step's (position p + k for chain p)
    for k in range(depth):
        start = 0 if k == 0 else first_chain  # step 0 also builds the keys of every earlier position
        positions = torch.arange(start + k, t + k).expand(b, t - start)
        past_k = torch.cat(keys, dim=2) if keys else hidden.new_zeros(b, drafter.config.num_kv_heads, 0,
                                                                       drafter.config.head_dim)
        past_v = torch.cat(values, dim=2) if values else past_k
        mask = torch.cat([causal[start:]] + [own] * k, dim=-1)[None, None, None]
        if k > 0:
            key_pos = torch.cat([key_pos, positions[0]])
        normed, hidden, new_k, new_v = drafter.step(next_ids[:, start + k:t + k], hidden, positions, past_k, past_v,
                                                    mask, key_pos)
        keys.append(new_k)
        values.append(new_v)
        if k == 0:
            normed, hidden = normed[:, first_chain:], hidden[:, first_chain:]
        out.append(drafter.lm_head(normed))
    return out


@torch.no_grad()
def replay_greedy(drafter: Drafter, sequence: list[int], aux: torch.Tensor, prompt_len: int,
                  max_new_tokens: int, depths, eos_ids=()) -> dict[int, SpeculativeResult]:
    """The greedy loop's accepted counts for several depths at once, from a target-greedy `sequence`.

    sequence: the prompt then the target's greedy continuation, at least max_new_tokens + max(depths)
    tokens long past the prompt and not cut at EOS (the loop verifies drafts past an EOS too);
    aux [1, len(sequence)-1, A*Ht]: the target's aux states of sequence[:-1]. Greedy output is the
    target's whatever the drafter does, so round r starts at a known length L and its accepted count
    is the number of leading drafts of the chain after sequence[:L+1] that match the sequence."""
    max_depth = max(depths)
    assert len(sequence) >= prompt_len + max_new_tokens + max_depth
    ids = torch.tensor([sequence])
    chains = len(sequence) - max_depth  # the chains at positions 0 .. chains-1 have every token they need
    first = prompt_len - 1  # the first round's chain
    logits = parallel_drafts(drafter, ids[:, 1:], aux[:, :chains], max_depth, first_chain=first)
    drafts = torch.stack([drafter.to_target_ids(lg[0].argmax(-1)) for lg in logits])  # [K, chains - first]
    results = {}
    for depth in depths:
        res = SpeculativeResult(tokens=[sequence[prompt_len]], depth=depth)
        length = prompt_len  # target cache length; sequence[length] is the token about to be verified
        while len(res.tokens) < max_new_tokens and res.tokens[-1] not in eos_ids:
            p = length - 1  # the chain's step 0 sits at position p and predicts sequence[p + 2]
            chain = drafts[:depth, p - first].tolist()
            m = next((i for i in range(depth) if chain[i] != sequence[length + 1 + i]), depth)
            res.accepted.append(m)
            new_tokens = sequence[length + 1:length + 2 + m]
            for i, tok in enumerate(new_tokens):
                if tok in eos_ids:
                    new_tokens = new_tokens[:i + 1]
                    break
            res.tokens += new_tokens[:max_new_tokens - len(res.tokens)]
            length += m + 1
        results[depth] = res
    return results
