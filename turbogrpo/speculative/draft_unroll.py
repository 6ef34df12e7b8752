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
step is exactly teacher forcing's loss.

The teacher-forced step 0 is the shared-prefix pack's forward (each prompt once per group, as in teacher forcing);
steps t >= 1 query a window per completion, its trained tokens and the last k - 1 prompt pairs before them, whose
keys are gathered from the pack's. The same unrolled predictions measure acceptance by depth on held-out data
(``draft_acceptance.py``).

Legend: T packed positions, B completions, L a completion's own sequence (prompt pairs + trained tokens),
W its window, Hd hidden size.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from turbogrpo.speculative.draft import DraftHead, shift_features


STEP_DECAY = 0.8
"""Weight of unrolled step t relative to step t - 1 (EAGLE-3's 0.8 ** t)."""


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


class UnrolledBatch(NamedTuple):
    """The positions the unrolled steps t >= 1 query, per completion: a window of its trained tokens and the
    last ``num_steps - 1`` prompt pairs before them (whose later-step outputs feed the first completion
    tokens' inputs), right-padded to W. The teacher-forced step 0 runs on the shared-prefix pack."""

    packed: NamedTuple            # the teacher-forced pack (draft_training.PackedDraftBatch)
    teacher_index_BL: torch.Tensor   # [B, L] pack index of each position of the completion's own sequence
    window_index_BW: torch.Tensor    # [B, W] pack index of each window position (0 on padding)
    previous_index_BW: torch.Tensor  # [B, W] pack index of the position before (-1: none or padding)
    positions_BW: torch.Tensor       # [B, W] position ids s of the window
    trained_BW: torch.Tensor         # bool: a trained completion token
    target_row_BW: torch.Tensor      # [B, W] its row in ``packed.targets_MH`` (0 where not trained)


def unrolled_batch(packed: NamedTuple, num_steps: int) -> UnrolledBatch:
    """The windows of ``num_steps`` unrolled steps over ``packed`` (``draft_training.pack_draft_batch``'s, which
    the teacher-forced step runs on)."""
    device = packed.tokens_T.device
    prompt_starts = [0, *itertools.accumulate(packed.prompt_lengths)]
    completion_starts = [packed.num_prompt_tokens + n for n in (0, *itertools.accumulate(packed.completion_lengths))]
    target_starts = [0, *itertools.accumulate(packed.completion_lengths)]
    teacher, window, previous, targets, trained = [], [], [], [], []
    for b, (length, prompt) in enumerate(zip(packed.completion_lengths, packed.completion_prompts)):
        num_prompt = packed.prompt_lengths[prompt]
        index = torch.cat([torch.arange(prompt_starts[prompt], prompt_starts[prompt] + num_prompt),
                           torch.arange(completion_starts[b], completion_starts[b] + length)])
        start = max(num_prompt - (num_steps - 1), 0)
        teacher.append(index)
        window.append(index[start:])
        previous.append(torch.cat([index[start - 1:start] if start else torch.tensor([-1]), index[start:-1]]))
        is_trained = torch.arange(start, len(index)) >= num_prompt
        trained.append(is_trained)
        targets.append(torch.where(is_trained, torch.arange(start, len(index)) - num_prompt + target_starts[b], 0))
    pad = functools.partial(torch.nn.utils.rnn.pad_sequence, batch_first=True)
    window_BW = pad(window, padding_value=0).to(device)
    return UnrolledBatch(packed, pad(teacher, padding_value=0).to(device), window_BW,
                         pad(previous, padding_value=-1).to(device), packed.positions_T[window_BW],
                         pad(trained, padding_value=False).to(device), pad(targets, padding_value=0).to(device))


class KeptKeys:
    """The teacher-forced pass's plan, keeping each layer's keys and values ``[1, Hkv, T, D]`` for later steps."""

    def __init__(self, plan, store: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        self.plan = plan
        self.store = store

    def __call__(self, module, query, key, value, *, scaling, sliding_window):
        self.store[module.layer_idx] = (key, value)
        return self.plan(module, query, key, value, scaling=scaling, sliding_window=sliding_window)


class UnrolledPlan:
    """The attention of unrolled step ``step`` >= 1 (module docstring) over its window: the teacher pass's keys of
    each completion's own sequence (gathered from the pack) and the window keys of steps 1..step, which it adds to
    ``store`` (per draft layer, the steps so far)."""

    def __init__(self, batch: UnrolledBatch, teacher: dict[int, tuple[torch.Tensor, torch.Tensor]],
                 store: dict[int, list[tuple[torch.Tensor, torch.Tensor]]], step: int):
        self.batch, self.teacher, self.store, self.step = batch, teacher, store, step
        device = batch.positions_BW.device
        num_positions = batch.teacher_index_BL.shape[1]
        query_BW1 = batch.positions_BW[:, :, None]
        teacher_L = torch.arange(num_positions, device=device)
        window_W = torch.arange(batch.positions_BW.shape[1], device=device)
        # Teacher keys up to the root (s - step); then step i's key of the ancestor at s - (step - i).
        blocks = [teacher_L <= query_BW1 - step] + [
            (window_W[None, None, :] == window_W[None, :, None] - (step - i)).expand(len(query_BW1), -1, -1)
            for i in range(1, step + 1)]
        self.visible_BWK = torch.cat(blocks, dim=2)
        self.distance_BWK = torch.cat([query_BW1 - teacher_L] + [query_BW1 - batch.positions_BW[:, None, :]] * step, 2)

    def _teacher(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s teacher keys and values ``[B, Hkv, L, D]`` per completion's own sequence."""
        index_BL = self.batch.teacher_index_BL
        return tuple(kept[0][:, index_BL].transpose(0, 1) for kept in self.teacher[layer])

    def __call__(self, module, query, key, value, *, scaling, sliding_window):
        steps = self.store.setdefault(module.layer_idx, [])
        steps.append((key, value))
        assert len(steps) == self.step, "unrolled steps must run in order"
        teacher_key, teacher_value = self._teacher(module.layer_idx)
        mask = self.visible_BWK
        if sliding_window is not None:
            mask = mask & (self.distance_BWK < sliding_window)
        keys = torch.cat([teacher_key, *(k for k, _ in steps)], dim=2)
        values = torch.cat([teacher_value, *(v for _, v in steps)], dim=2)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask[:, None], scale=scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2)


def unrolled_predictions(draft: DraftHead, batch: UnrolledBatch, num_steps: int) -> list[torch.Tensor]:
    """The draft's predicted features ``[B, W, Hd]`` at the window positions, for each of ``num_steps`` steps:
    step 0 teacher-forced on the pack (gathered), the later ones fed their previous step's predictions."""
    packed = batch.packed
    dtype = next(draft.parameters()).dtype
    teacher: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    predicted_TH = draft(draft.input_features(packed.features_TH[None].to(dtype)), packed.tokens_T[None],
                         packed.positions_T[None], KeptKeys(packed.plan, teacher))[0]
    predictions = [predicted_TH[batch.window_index_BW]]
    # Step 1 at s is fed step 0's prediction at s - 1, which may lie before the window (the pack has it).
    previous_BW = batch.previous_index_BW
    features_BWH = torch.where(previous_BW[..., None] >= 0, predicted_TH[previous_BW.clamp(min=0)], 0.0)
    tokens_BW = packed.tokens_T[batch.window_index_BW]
    store: dict[int, list] = {}
    for step in range(1, num_steps):
        predicted_BWH = draft(features_BWH, tokens_BW, batch.positions_BW, UnrolledPlan(batch, teacher, store, step))
        predictions.append(predicted_BWH)
        features_BWH = shift_features(predicted_BWH)  # g_t[s-1] feeds step t + 1 at s (window start: unused)
    return predictions


def step_mask(batch: UnrolledBatch, step: int) -> torch.Tensor:
    """``[B, W]`` bool: the window positions step ``step`` trains (trained tokens with a root s - step >= 0)."""
    return batch.trained_BW & (batch.positions_BW >= step)


def unrolled_draft_loss(draft: DraftHead, packed: NamedTuple, config) -> tuple[torch.Tensor, dict]:
    """``draft_training.draft_loss`` over ``config.ttt_steps`` unrolled steps of ``packed`` (its pack): step t's
    loss (the same terms) at the positions it trains, weighted ``STEP_DECAY ** t`` and normalised. Metrics: the
    weighted terms, top-1 agreement at depth 1 (``top1_agreement``) and at each depth (``top1_agreement_depth<d>``)."""
    batch = unrolled_batch(packed, config.ttt_steps)
    predictions = unrolled_predictions(draft, batch, config.ttt_steps)
    weights = [STEP_DECAY ** t for t in range(config.ttt_steps)]
    total, metrics = 0.0, {}
    for step, (predicted_BWH, weight) in enumerate(zip(predictions, weights)):
        mask_BW = step_mask(batch, step)
        if not bool(mask_BW.any()):  # host sync: a step past every completion's length trains nothing
            continue
        target_MH = batch.packed.targets_MH[batch.target_row_BW[mask_BW]].to(predicted_BWH.dtype)
        loss, step_metrics = position_losses(draft, predicted_BWH[mask_BW], target_MH, config)
        total = total + weight * loss
        for key in ("loss", "feature_loss", "logit_loss"):
            metrics[key] = metrics.get(key, 0.0) + weight * step_metrics[key]
        metrics[f"top1_agreement_depth{step + 1}"] = step_metrics["top1_agreement"]
    norm = sum(weights)
    metrics = {k: (v / norm if k in ("loss", "feature_loss", "logit_loss") else v) for k, v in metrics.items()}
    metrics["top1_agreement"] = metrics["top1_agreement_depth1"]
    return total / norm, metrics
