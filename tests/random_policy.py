"""A verify policy for tests: any decision the loop must survive, at random."""

import torch


class RandomDepth:
    """A verify policy that decides at random: skip the drafter, or verify any entry of the menu
    (for a chain: any k in 0..K drafts)."""

    def __init__(self, depth, seed=0, draft_rate=0.7):
        self.depth, self.draft_rate = depth, draft_rate
        self.rng = torch.Generator().manual_seed(seed)
        self.chosen = []

    def start(self, batch):
        pass

    def should_draft(self, live):
        self.live = live.clone()
        return bool(torch.rand(1, generator=self.rng) < self.draft_rate)

    def choose(self, reach, live, widths, drafts=None):
        return int(torch.randint(0, len(widths), (1,), generator=self.rng))

    def observe(self, depth, accepted, live, drafted, emitted=None):
        # The round's sequences as it began, though some finish in it (the runtime once passed its own
        # mask, which finishing sequences cleared, and a batch whose last sequences finished in a probe
        # reached the goodput policy with none live).
        assert torch.equal(live, self.live)
        self.chosen.append(depth if drafted else None)
