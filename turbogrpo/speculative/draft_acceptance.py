"""Acceptance by depth on held-out data: how far a draft's chains are accepted at T = 1 (``acceptance_by_depth``).

Each chain is rooted at a completion token and follows the data's tokens (the policy's own T = 1 samples): where
verification accepts, the accepted token is the one the data holds, so the next level's prediction is the draft's
own unrolled prediction of ``draft_unroll.py`` (training-time test's forward, without gradients).

Legend: B completions, W window positions, Hd hidden size, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from turbogrpo.batch import Groups
from turbogrpo.speculative.draft import DraftHead
from turbogrpo.speculative.draft_training import pack_draft_batch
from turbogrpo.speculative.draft_unroll import unrolled_batch, unrolled_predictions


@torch.no_grad()
def acceptance_by_depth(draft: DraftHead, groups: Groups, num_depths: int, *,
                        max_elements: int = 1 << 25) -> dict:
    """How far the draft's chains are accepted on ``groups`` (the policy's own T = 1 samples, never trained on),
    depth 1..``num_depths``, each chain rooted at a completion position and following the data's tokens:

    - ``top1_accepted``: share of roots whose top-1 draft token matched the sampled token at every depth up to d
      (a top-1 chain verified by "sample, then match" at T = 1 is accepted exactly that often);
    - ``expected_acceptance``: the mean of sum_x min(p(x), q(x)) at depth d (p the policy's distribution, q the
      draft's), the chance that lossless speculative sampling accepts a token the draft *sampled* there;
    - ``sampled_accepted``: the mean over roots of the product of those up to d (a sampled chain's acceptance
      through depth d, with the data's path standing for the accepted one);
    - ``top1_agreement``: the draft's argmax equals the policy's at depth 1 (teacher-forced);
    - ``tokens_per_verification``: 1 + the sum over depths of ``top1_accepted`` (resp. ``sampled_accepted``):
      the tokens a single chain of ``num_depths`` emits per policy forward.

    Rows are measured a group at a time, as many per pass as keep a ``[B, W, V]`` tensor within ``max_elements``.
    """
    sums = {k: torch.zeros(num_depths, dtype=torch.float64) for k in ("top1", "expected", "sampled", "roots")}
    agreement, agreement_count = 0.0, 0
    for group in range(groups.num_groups):  # a group at a time, a few rows per pass: [B, W, V] stays small
        packed = pack_draft_batch(groups.select([group]), requires_grad=False,
                                  context_start=draft.layout.context_start, hidden_size=draft.config.hidden_size)
        batch = unrolled_batch(packed, num_depths)
        predictions = unrolled_predictions(draft, batch, num_depths)
        num_rows, num_positions = batch.positions_BW.shape
        rows_per_pass = max(1, max_elements // (num_positions * draft.config.vocab_size))
        targets_BWH = packed.targets_MH[batch.target_row_BW].to(predictions[0].dtype)
        next_tokens_BW = torch.where(batch.trained_BW, packed.next_tokens_M[batch.target_row_BW], -1)
        for start in range(0, num_rows, rows_per_pass):
            rows = slice(start, start + rows_per_pass)
            trained_BW, next_tokens = batch.trained_BW[rows], next_tokens_BW[rows]
            policy_logp_BWV = draft.logits(targets_BWH[rows]).float().log_softmax(-1)
            top1_ok = torch.ones_like(trained_BW)
            product_BW = torch.ones(trained_BW.shape, dtype=torch.float64, device=trained_BW.device)
            alive_BW = torch.ones_like(trained_BW)
            for depth, predicted_BWH in enumerate(predictions):
                draft_logp_BWV = draft.draft_logprobs(predicted_BWH[rows])
                overlap_BW = torch.minimum(draft_logp_BWV, policy_logp_BWV).exp().sum(-1).double()
                draft_top1_BW = draft_logp_BWV.argmax(-1)
                if depth == 0:
                    agree = (draft_top1_BW == policy_logp_BWV.argmax(-1)) & trained_BW
                    agreement += float(agree.sum())
                    agreement_count += int(trained_BW.sum())

                def at_root(values_BW: torch.Tensor, fill) -> torch.Tensor:
                    """Per root at window position j, the value at this depth's node j + depth (windows are
                    consecutive positions; ``fill`` past the row)."""
                    return F.pad(values_BW[:, depth:], (0, depth), value=fill)

                alive_BW = alive_BW & at_root(trained_BW & (next_tokens >= 0), False)
                top1_ok = top1_ok & at_root(draft_top1_BW == next_tokens, False)
                product_BW = product_BW * at_root(overlap_BW, 0.0)
                sums["roots"][depth] += float(alive_BW.sum())
                sums["top1"][depth] += float((top1_ok & alive_BW).sum())
                sums["sampled"][depth] += float(product_BW[alive_BW].sum())
                sums["expected"][depth] += float(at_root(overlap_BW, 0.0)[alive_BW].sum())
    roots = sums["roots"].clamp(min=1)
    result = {"num_roots": sums["roots"].tolist(),
              "top1_accepted": (sums["top1"] / roots).tolist(),
              "expected_acceptance": (sums["expected"] / roots).tolist(),
              "sampled_accepted": (sums["sampled"] / roots).tolist(),
              "top1_agreement": agreement / max(1, agreement_count)}
    result["tokens_per_verification_top1"] = 1.0 + sum(result["top1_accepted"])
    result["tokens_per_verification_sampled"] = 1.0 + sum(result["sampled_accepted"])
    return result


def rows_by_depth(acceptance: dict) -> list[dict]:
    """``acceptance_by_depth``'s figures as one row per depth (``depth``, ``num_roots``, ``top1_accepted``,
    ``expected_acceptance``, ``sampled_accepted``), for reports and tables."""
    keys = ("num_roots", "top1_accepted", "expected_acceptance", "sampled_accepted")
    return [{"depth": depth, **dict(zip(keys, values))}
            for depth, values in enumerate(zip(*(acceptance[k] for k in keys)), 1)]
