"""One optimizer step of the policy on a step batch, and the forward-only scoring of a step batch.

Both run the batch micro-batch by micro-batch through the shared-prefix forward. The update sums the
micro-batch losses' gradients (each loss is already divided by whole-batch totals, so the sum is the
full-batch gradient), clips the global norm, and applies the step only if loss and norm are finite.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from turbogrpo.algo import LossNormalizer
from turbogrpo.batch import Layout as Groups
from turbogrpo.train.distributed import DistInfo, all_reduce_sum, gradient_sync
from turbogrpo.train.microbatch import Chunk, MicroBatch, length_mask, pad_ragged


@dataclass
class StepBatch:
    """This rank's share of one GRPO step: K groups, N completions flat in group-major order.

    prompts: K prompt token ids, each ``[P_k]``.
    groups: the layout (how many of the N completions each group has, and where they start).
    completions: N completion token ids, each ``[S_i]``.
    advantages: ``[N]``, one per completion.
    old_logps: N ``[S_i]`` log-probs under the policy that sampled them, or None (num_iterations == 1:
        the ratio is exactly 1 and TRL skips this forward too).
    ref_logps: the same under the reference policy, or None (beta == 0).
    rollout_logps: the same as the sampler computed them while sampling, or None (no TIS correction).
    """

    prompts: list[Tensor]
    groups: Groups
    completions: list[Tensor]
    advantages: Tensor
    old_logps: list[Tensor] | None = None
    ref_logps: list[Tensor] | None = None
    rollout_logps: list[Tensor] | None = None

    @classmethod
    def from_groups(cls, prompts: list[Tensor], completions: Sequence[Sequence[Tensor]], advantages: Tensor,
                    old_logps=None, ref_logps=None, rollout_logps=None) -> StepBatch:
        """A batch from per-group lists (completions, and the per-token fields that are given)."""
        def flat(nested):
            return None if nested is None else Groups.flatten(nested)
        return cls(prompts, Groups.of(completions), Groups.flatten(completions), advantages, flat(old_logps),
                   flat(ref_logps), flat(rollout_logps))

    def select(self, keep: Sequence[int]) -> StepBatch:
        """The batch restricted to groups ``keep``, in that order."""
        groups, index = self.groups.select(keep)

        def pick(items):
            return None if items is None else [items[i] for i in index]
        return StepBatch([self.prompts[g] for g in keep], groups, pick(self.completions),
                         self.advantages[torch.tensor(index, device=self.advantages.device)], pick(self.old_logps),
                         pick(self.ref_logps), pick(self.rollout_logps))

    def completion_lengths(self) -> list[list[int]]:
        """Per group, its completions' lengths (what micro-batch planning reads)."""
        return self.groups.split([c.numel() for c in self.completions])

    def chunk_completions(self, chunks: Sequence[Chunk]) -> list[list[Tensor]]:
        """Per chunk, its run of completions (the nested layout the shared-prefix forward takes)."""
        starts = self.groups.offsets
        return [self.completions[starts[c.group] + c.start:starts[c.group] + c.stop] for c in chunks]


@dataclass
class UpdateResult:
    """What one optimizer step did.

    applied: False when loss or gradient norm was NaN/inf and the step was skipped.
    grad_norm: global gradient norm before clipping.
    metrics: the loss's metrics (loss, loss/policy, clip_ratio/*, kl ...) over the global batch, and
        the mean entropy per completion token the update ran.
    logps: per completion ``[S]`` (flat, group-major) trainer log-probs before the step, detached.
    """

    applied: bool
    grad_norm: float
    metrics: dict[str, float]
    logps: list[Tensor]


def update_policy(module: nn.Module, batch: StepBatch, micro_batches: Sequence[MicroBatch], loss_fn: Callable,
                  normalizer: LossNormalizer, optimizer: torch.optim.Optimizer, *, max_grad_norm: float,
                  dist: DistInfo) -> UpdateResult:
    """Accumulate the gradient of the step batch over ``micro_batches`` and take one optimizer step.

    ``module(prompts, completions) -> CompletionLogprobs`` is the (possibly DDP/FSDP2-wrapped)
    shared-prefix forward; ``loss_fn`` a policy loss with its settings bound (``algo.build_loss``).
    Every rank passes the same number of micro-batches (fillers have weight 0).
    """
    optimizer.zero_grad(set_to_none=True)
    totals: dict[str, Tensor] = {}
    logps_by_index: dict[int, Tensor] = {}
    for i, mb in enumerate(micro_batches):
        with gradient_sync(module, enabled=i == len(micro_batches) - 1):
            prompts = [batch.prompts[c.group] for c in mb.chunks]
            result = module(prompts, batch.chunk_completions(mb.chunks))
            logps = Groups.flatten(result.per_completion(result.logps))
            mask_BL = length_mask([t.numel() for t in logps], device=logps[0].device)
            loss, metrics = loss_fn(
                pad_ragged(logps),
                _padded(batch.old_logps, mb),
                _padded(batch.ref_logps, mb),
                batch.advantages[torch.tensor(mb.index, device=batch.advantages.device)],
                mask_BL, normalizer, rollout_logps=_padded(batch.rollout_logps, mb))
            (loss * mb.weight).backward()
        metrics["entropy_sum"] = result.entropy.sum()
        metrics["num_tokens"] = mask_BL.sum()
        for name, value in {"loss": loss.detach(), **metrics}.items():
            totals[name] = totals.get(name, 0.0) + value * mb.weight
        if mb.weight:
            logps_by_index.update(zip(mb.index, (t.detach() for t in logps)))

    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
    names = sorted(totals)
    # Loss totals are per-rank shares of the global batch's (totals divided by world size), so their
    # sum over ranks divided by the world size is the global value.
    stats = all_reduce_sum(torch.stack([totals[n] for n in names]), dist) / dist.world_size
    grad_norm = _full(grad_norm).to(stats.device)
    finite = torch.isfinite(stats).all() & torch.isfinite(grad_norm)
    # Host sync: whether to apply the step is a Python decision; values are fetched in the same sync.
    values = torch.cat([finite.to(stats.dtype)[None], grad_norm.to(stats.dtype)[None], stats]).tolist()
    applied = bool(values[0])
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    metrics = dict(zip(names, values[2:]))
    # Mean entropy of the sampling distribution over the completion tokens this update ran.
    metrics["entropy"] = metrics.pop("entropy_sum") / max(metrics.pop("num_tokens"), 1.0)
    return UpdateResult(applied=applied, grad_norm=values[1], metrics=metrics,
                        logps=[logps_by_index[i] for i in sorted(logps_by_index)])


@torch.no_grad()
def score(module: nn.Module, batch: StepBatch, micro_batches: Sequence[MicroBatch]) -> list[Tensor]:
    """Per completion ``[S]`` log-probs under ``module`` (no gradient), micro-batched; flat like
    ``batch.completions``."""
    out: list[Tensor | None] = [None] * len(batch.completions)
    for mb in micro_batches:
        # Scoring needs only the log-probs: no entropy pass over the [tokens, vocab] logits.
        result = module([batch.prompts[c.group] for c in mb.chunks], batch.chunk_completions(mb.chunks),
                        with_entropy=False)
        if mb.weight:
            for i, logps in zip(mb.index, Groups.flatten(result.per_completion(result.logps))):
                out[i] = logps.detach()
    return out


def _padded(flat: list[Tensor] | None, mb: MicroBatch) -> Tensor | None:
    """``[B, L]``: the micro-batch's completions' rows of a flat per-token field, right-padded with 0."""
    return None if flat is None else pad_ragged([flat[i] for i in mb.index])


def _full(t: Tensor) -> Tensor:
    """A plain tensor from a possibly sharded (DTensor) one."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
