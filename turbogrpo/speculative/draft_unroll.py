"""Training-time test (EAGLE-3's TTT, HASS's harmonised context): the draft run on its own earlier predictions.

At decode time only the tree's root is fed the policy's feature; a node at depth d is fed its parent's
*predicted* feature and sees the committed context (policy features) plus its d - 1 drafted ancestors.
Teacher forcing trains only depth 1. Unrolling ``k`` steps trains depths 1..k as they are met:

    step 0 at position s: input (f[s-1], x[s]), attends to step-0 keys u <= s            (teacher forcing)
    step t at position s: input (g_{t-1}[s-1], x[s]), the depth-(t+1) node of root s - t: attends to step-0 keys
                          u <= s - t (the committed context) and to the step-i key at u = s - (t - i), i = 1..t
                          (its drafted ancestors, then itself)

Every step predicts f[s] (its target is the same), and positions keep their ids (root + depth = s).
The loss is EAGLE-3's: the per-step losses weighted 0.8^t, here normalised by the weights' sum so that one
step is exactly teacher forcing's loss. Rows are one completion each, right-padded (the prompt repeated
per completion; the shared-prefix pack of ``draft_training`` has no room for the steps' keys).

The same unrolled predictions measure acceptance by depth on held-out data (``acceptance_by_depth``).

Legend: B rows (completions), T positions, S steps, Hd hidden size, X policy feature width, V vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from turbogrpo.batch import Groups
from turbogrpo.speculative.draft import DraftHead, prompt_pairs, shift_features

STEP_DECAY = 0.8
"""Weight of unrolled step t relative to step t - 1 (EAGLE-3's 0.8 ** t)."""


class UnrolledBatch(NamedTuple):
    """One completion per row, right-padded, from the first prompt pair the draft sees."""

    tokens_BT: torch.Tensor      # x[s] (0 on padding)
    features_BTX: torch.Tensor   # the policy's f[s-1] (wide for "eagle3"; 0 on padding)
    targets_BTH: torch.Tensor    # f[s], the final feature (0 where not trained)
    trained_BT: torch.Tensor     # bool: a completion token whose next feature is known
    next_tokens_BT: torch.Tensor  # x[s+1] where known, else -1


def position_losses(draft: DraftHead, predicted_MH: torch.Tensor, target_MH: torch.Tensor,
                     config) -> tuple[torch.Tensor, dict]:
    """The loss and metrics of ``draft_training.draft_loss`` at M positions: predicted features ``[M, Hd]`` against the
    policy's ``[M, Hd]``."""
    feature_loss = F.smooth_l1_loss(predicted_MH.float(), target_MH.float())
    with torch.no_grad():
        target_probs_MV = draft.vocabulary_logits(target_MH).float().softmax(-1)
    draft_logprobs_MV = draft.vocabulary_logits(predicted_MH).float().log_softmax(-1)
    logit_loss = -(target_probs_MV * draft_logprobs_MV).sum(-1).mean()
    loss = config.feature_weight * feature_loss + config.logit_weight * logit_loss
    top1 = (draft_logprobs_MV.argmax(-1) == target_probs_MV.argmax(-1)).float().mean()
    return loss, {"loss": loss.detach(), "feature_loss": feature_loss.detach(), "logit_loss": logit_loss.detach(),
                  "top1_agreement": top1}


def pad_completions(groups: Groups, context_start: int, hidden_size: int) -> UnrolledBatch:
    """``groups`` (with ``prompt_hidden`` and ``hidden``) as ``UnrolledBatch`` rows; completions with no trained
    token are left out."""
    rows = []
    for prompt, prompt_features, group, group_features in zip(groups.prompts, groups.prompt_hidden,
                                                              groups.nested(), groups.split(groups.hidden)):
        prompt_tokens, prompt_inputs = prompt_pairs(prompt, prompt_features, context_start)
        for completion, features in zip(group, group_features):
            num = min(len(completion), len(features) - 1)
            if num < 1:
                continue
            num_prompt = len(prompt_tokens)
            tokens = torch.cat([prompt_tokens, completion[:num].to(prompt_tokens.device)])
            inputs = torch.cat([prompt_inputs, features[:num]])
            targets = torch.cat([features.new_zeros(num_prompt, hidden_size), features[1:num + 1, -hidden_size:]])
            trained = torch.arange(len(tokens)) >= num_prompt
            following = completion[1:num + 1].to(tokens.device)
            next_tokens = torch.cat([tokens.new_full((num_prompt,), -1), following,
                                     tokens.new_full((num - len(following),), -1)])
            rows.append((tokens, inputs, targets, trained.to(tokens.device), next_tokens))
    if not rows:
        raise ValueError("no draft training data: every completion is shorter than two features")
    padded = [torch.nn.utils.rnn.pad_sequence(list(column), batch_first=True, padding_value=value)
              for column, value in zip(zip(*rows), (0, 0.0, 0.0, False, -1))]
    return UnrolledBatch(*padded)


class UnrolledPlan:
    """The attention of unrolled step ``step`` (module docstring): it adds its keys and values to ``store``
    (per draft layer, one entry per step so far) and attends over all of them with the step's mask."""

    def __init__(self, store: dict[int, list[tuple[torch.Tensor, torch.Tensor]]], step: int, num_positions: int,
                 device: torch.device):
        self.store = store
        self.step = step
        query_T = torch.arange(num_positions, device=device)[:, None]
        key_T = torch.arange(num_positions, device=device)[None, :]
        blocks = [key_T <= query_T - step] + [key_T == query_T - (step - i) for i in range(1, step + 1)]
        self.visible_TK = torch.cat(blocks, dim=1)        # [T, (step + 1) * T]
        self.distance_TK = (query_T - key_T).repeat(1, step + 1)

    def __call__(self, module, query, key, value, *, scaling, sliding_window):
        steps = self.store.setdefault(module.layer_idx, [])
        steps.append((key, value))
        assert len(steps) == self.step + 1, "unrolled steps must run in order"
        mask = self.visible_TK
        if sliding_window is not None:
            mask = mask & (self.distance_TK < sliding_window)
        keys = torch.cat([k for k, _ in steps], dim=2)
        values = torch.cat([v for _, v in steps], dim=2)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2)


def unrolled_predictions(draft: DraftHead, batch: UnrolledBatch, num_steps: int) -> list[torch.Tensor]:
    """The draft's predicted features ``[B, T, Hd]`` at each of ``num_steps`` unrolled steps (module docstring)."""
    num_rows, num_positions = batch.tokens_BT.shape
    device = batch.tokens_BT.device
    positions_BT = torch.arange(num_positions, device=device).expand(num_rows, -1)
    dtype = next(draft.parameters()).dtype
    features_BTH = draft.input_features(batch.features_BTX.to(dtype))
    store: dict[int, list] = {}
    predictions = []
    for step in range(num_steps):
        predicted_BTH = draft(features_BTH, batch.tokens_BT, positions_BT,
                              UnrolledPlan(store, step, num_positions, device))
        predictions.append(predicted_BTH)
        features_BTH = shift_features(predicted_BTH)  # g_t[s-1] feeds step t + 1 at s
    return predictions


def step_mask(batch: UnrolledBatch, step: int) -> torch.Tensor:
    """``[B, T]`` bool: the positions step ``step`` trains (trained, with a root at s - step >= 0)."""
    return batch.trained_BT & (torch.arange(batch.trained_BT.shape[1], device=batch.trained_BT.device) >= step)


def unrolled_draft_loss(draft: DraftHead, groups: Groups, config) -> tuple[torch.Tensor, dict]:
    """``draft_training.draft_loss`` over ``config.ttt_steps`` unrolled steps: step t's loss (the same terms) at
    the positions it trains, weighted ``STEP_DECAY ** t`` and normalised. Metrics: the weighted terms, top-1
    agreement at depth 1 (``top1_agreement``) and at each depth (``top1_agreement_depth<d>``)."""
    batch = pad_completions(groups, draft.layout.context_start, draft.config.hidden_size)
    predictions = unrolled_predictions(draft, batch, config.ttt_steps)
    weights = [STEP_DECAY ** t for t in range(config.ttt_steps)]
    total, metrics = 0.0, {}
    for step, (predicted_BTH, weight) in enumerate(zip(predictions, weights)):
        mask_BT = step_mask(batch, step)
        if not bool(mask_BT.any()):  # host sync: a step past every completion's length trains nothing
            continue
        loss, step_metrics = position_losses(draft, predicted_BTH[mask_BT], batch.targets_BTH[mask_BT]
                                              .to(predicted_BTH.dtype), config)
        total = total + weight * loss
        for key in ("loss", "feature_loss", "logit_loss"):
            metrics[key] = metrics.get(key, 0.0) + weight * step_metrics[key]
        metrics[f"top1_agreement_depth{step + 1}"] = step_metrics["top1_agreement"]
    norm = sum(weights)
    metrics = {k: (v / norm if k in ("loss", "feature_loss", "logit_loss") else v) for k, v in metrics.items()}
    metrics["top1_agreement"] = metrics["top1_agreement_depth1"]
    return total / norm, metrics


@torch.no_grad()
def acceptance_by_depth(draft: DraftHead, groups: Groups, num_depths: int, *, rows_per_pass: int = 4) -> dict:
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
    """
    sums = {k: torch.zeros(num_depths, dtype=torch.float64) for k in ("top1", "expected", "sampled", "roots")}
    agreement, agreement_count = 0.0, 0
    for group in range(groups.num_groups):  # a group at a time, a few rows per pass: [B, T, V] stays small
        group_batch = pad_completions(groups.select([group]), draft.layout.context_start, draft.config.hidden_size)
        for start in range(0, group_batch.tokens_BT.shape[0], rows_per_pass):
            batch = UnrolledBatch(*(t[start:start + rows_per_pass] for t in group_batch))
            predictions = unrolled_predictions(draft, batch, num_depths)
            policy_logp_BTV = draft.logits(batch.targets_BTH.to(predictions[0].dtype)).float().log_softmax(-1)
            ok_top1 = torch.ones_like(batch.trained_BT)
            product = torch.ones(batch.tokens_BT.shape, dtype=torch.float64, device=batch.tokens_BT.device)
            alive = torch.ones_like(batch.trained_BT)
            for depth, predicted_BTH in enumerate(predictions):
                draft_logp_BTV = draft.draft_logprobs(predicted_BTH)
                overlap_BT = torch.minimum(draft_logp_BTV, policy_logp_BTV).exp().sum(-1).double()
                top1_BT = draft_logp_BTV.argmax(-1) == batch.next_tokens_BT
                if depth == 0:
                    agree = (draft_logp_BTV.argmax(-1) == policy_logp_BTV.argmax(-1)) & batch.trained_BT
                    agreement += float(agree.sum())
                    agreement_count += int(batch.trained_BT.sum())
                def at_root(values_BT: torch.Tensor, fill) -> torch.Tensor:
                    """Per root r, the value at this depth's node r + depth (``fill`` past the row)."""
                    return F.pad(values_BT[:, depth:], (0, depth), value=fill)

                alive = alive & at_root(batch.trained_BT & (batch.next_tokens_BT >= 0), False)
                ok_top1 = ok_top1 & at_root(top1_BT, False)
                product = product * at_root(overlap_BT, 0.0)
                sums["roots"][depth] += float(alive.sum())
                sums["top1"][depth] += float((ok_top1 & alive).sum())
                sums["sampled"][depth] += float(product[alive].sum())
                sums["expected"][depth] += float(at_root(overlap_BT, 0.0)[alive].sum())
    roots = sums["roots"].clamp(min=1)
    result = {"num_roots": sums["roots"].tolist(),
              "top1_accepted": (sums["top1"] / roots).tolist(),
              "expected_acceptance": (sums["expected"] / roots).tolist(),
              "sampled_accepted": (sums["sampled"] / roots).tolist(),
              "top1_agreement": agreement / max(1, agreement_count)}
    result["tokens_per_verification_top1"] = 1.0 + sum(result["top1_accepted"])
    result["tokens_per_verification_sampled"] = 1.0 + sum(result["sampled_accepted"])
    return result
