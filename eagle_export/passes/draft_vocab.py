"""Vocabulary passes: the drafter emits target ids through one table, and shares the target's embeddings."""

from __future__ import annotations

import torch

from .base import PassBase, PassResult, PostconditionError
from .eagle_models import EagleModels, nbytes


class ApplyDraftVocab(PassBase):
    """Replace the d2t offsets by an absolute draft->target id table (one Gather in the graph); drop t2d.

    EAGLE-3 stores d2t as offsets: target = draft + d2t[draft] (a Gather and an Add). The table
    draft_to_target = arange(Vd) + d2t gives the same ids with one Gather, in Drafter.to_target_ids;
    it has d2t's size and dtype and replaces it. t2d (which target ids the draft vocabulary covers)
    is a training-time mask no graph or runtime step reads: dropped. Exact: integer arithmetic.
    """

    name = "apply_draft_vocab"

    def requires(self, models: EagleModels) -> str | None:
        d = models.drafter
        if d is None:
            return "no drafter"
        if d.draft_to_target is not None:
            return "the drafter already maps draft ids through an absolute table"
        if d.config.draft_vocab_size == d.config.vocab_size and not d.d2t.any():
            return "the draft vocabulary is the target's and d2t is identity: draft ids are target ids"
        return None

    def call(self, models: EagleModels) -> PassResult:
        d = models.drafter
        saved = nbytes(d.d2t) + nbytes(d.t2d)
        d.draft_to_target = torch.arange(len(d.d2t), device=d.d2t.device) + d.d2t
        saved -= nbytes(d.draft_to_target)
        del d.d2t, d.t2d
        return PassResult(models, modified=True, changes={
            "tensors_rewritten": 1, "tensors_removed": 1, "bytes_saved": saved})

    def ensures(self, models: EagleModels) -> None:
        table, vocab = models.drafter.draft_to_target, models.drafter.config.vocab_size
        if table is None or int(table.min()) < 0 or int(table.max()) >= vocab:
            raise PostconditionError(f"draft_to_target holds ids outside the target vocabulary [0, {vocab})")


class ShareEmbeddings(PassBase):
    """Make the drafter use the target's embedding table (the same Parameter); drop an identical copy.

    A drafter whose checkpoint carries its own table bit-identical to the target's computes the
    same embeddings from the target's, so its copy is dropped (bytes_saved). A table that differs
    is kept (skipped with the reason): sharing it would change the drafter's outputs. After the
    pass a build stores the table once.
    """

    name = "share_embeddings"

    def requires(self, models: EagleModels) -> str | None:
        t, d = models.target, models.drafter
        if t is None or d is None:
            return "needs both the target and the drafter"
        own = d.embed_tokens
        if own is t.embed_tokens or (own is not None and own.weight is t.embed_tokens.weight):
            return "the drafter already shares the target's embedding table"
        if own is not None:
            mine, theirs = own.weight, t.embed_tokens.weight
            if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
                return (f"the drafter's own embedding table ({tuple(mine.shape)}, {mine.dtype}) is not the "
                        f"target's ({tuple(theirs.shape)}, {theirs.dtype}): sharing would change its outputs")
            if not torch.equal(mine, theirs):
                diff = float((mine.float() - theirs.float()).abs().max())
                return (f"the drafter's own embedding table differs from the target's (max abs diff {diff:.3g}): "
                        "sharing would change its outputs")
        return None

    def call(self, models: EagleModels) -> PassResult:
        d = models.drafter
        own = d.embed_tokens
        params = own.weight.numel() if own is not None else 0
        saved = nbytes(own.weight) if own is not None else 0
        d.share_embeddings(models.target.embed_tokens)
        return PassResult(models, modified=True, changes={
            "tables_shared": 1, "params_removed": params, "bytes_saved": saved})

    def ensures(self, models: EagleModels) -> None:
        if models.drafter.embed_tokens.weight is not models.target.embed_tokens.weight:
            raise PostconditionError("the drafter does not use the target's embedding table")
