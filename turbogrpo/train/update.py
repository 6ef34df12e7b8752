"""One optimizer step of the policy on a step batch, and the forward-only scoring of a step batch.

Both run the batch micro-batch by micro-batch (``Groups.micro_batches``: each a ``Groups`` of its own,
together every completion once, in the batch's flat order) through the shared-prefix forward. The update sums the
micro-batch losses' gradients (each loss is already divided by whole-batch totals, so the sum is the
full-batch gradient), clips the global norm, and applies the step only if loss and norm are finite.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from turbogrpo.algo import LossNormalizer
from turbogrpo.batch import Groups, pad_ragged
from turbogrpo.moe_routes import ReplayCounts
from turbogrpo.placement import DistInfo
from turbogrpo.train.distributed import all_reduce_sum, gradient_sync


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


def update_policy(module: nn.Module, micro_batches: Sequence[Groups], loss_fn: Callable, normalizer: LossNormalizer,
                  optimizer: torch.optim.Optimizer, *, max_grad_norm: float, dist: DistInfo) -> UpdateResult:
    """Accumulate the gradient of the step batch over its ``micro_batches`` and take one optimizer step.

    ``module(prompts, completions) -> CompletionLogprobs`` is the (possibly DDP/FSDP2-wrapped)
    shared-prefix forward; ``loss_fn`` a policy loss with its settings bound (``algo.build_loss``). A
    micro-batch carries the advantages and the old / reference / sampler log-probs the loss reads
    (None where the loss does not need them). Every rank passes the same number of micro-batches
    (fillers have weight 0).
    """
    optimizer.zero_grad(set_to_none=True)
    totals: dict[str, Tensor] = {}
    logps_out: list[Tensor] = []
    for i, mb in enumerate(micro_batches):
        route_counts = ReplayCounts()
        with gradient_sync(module, enabled=i == len(micro_batches) - 1):
            result = module(mb.prompts, mb.nested(), **replayed_routes(mb, route_counts))
            mask_BL = mb.mask(result.logps.device)
            logps = mb.per_completion(result.logps)
            loss, metrics = loss_fn(pad_ragged(logps), mb.padded("old_logps"), mb.padded("ref_logps"), mb.advantages,
                                    mask_BL, normalizer, rollout_logps=mb.padded("sampler_logps"))
            (loss * mb.weight).backward()
        # Over the sampled tokens only: environment ids (model_mask 0) were never drawn from the policy.
        metrics["entropy_sum"] = (pad_ragged(mb.per_completion(result.entropy)) * mask_BL).sum()
        metrics["num_tokens"] = mask_BL.sum()
        if mb.routes is not None:  # summed over micro-batches as counts; their ratio is the share
            metrics["route_tokens"] = torch.as_tensor(route_counts.num_tokens).to(mask_BL)
            metrics["route_tokens_differing"] = torch.as_tensor(route_counts.num_differing).to(mask_BL)
        for name, value in {"loss": loss.detach(), **metrics}.items():
            totals[name] = totals.get(name, 0.0) + value * mb.weight
        if mb.weight:  # the micro-batches hold the batch's completions in its flat order
            logps_out.extend(t.detach() for t in logps)

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
    if "route_tokens" in metrics:  # the share of replayed tokens the trainer's routers would have routed otherwise
        metrics["mismatch/frac_tokens_routes_differ"] = (metrics.pop("route_tokens_differing")
                                                         / max(metrics.pop("route_tokens"), 1.0))
    return UpdateResult(applied=applied, grad_norm=values[1], metrics=metrics, logps=logps_out)


@torch.no_grad()
def score(module: nn.Module, micro_batches: Sequence[Groups], name: str) -> list[Tensor]:
    """Per completion ``[S_i]`` log-probs under ``module`` (no gradient), kept on each micro-batch as its
    per-token field ``name`` ("old_logps" or "ref_logps", which the update's loss reads) and returned
    flat over the batch. Fillers are scored too: their forwards keep the ranks' collectives matched."""
    flat: list[Tensor] = []
    for mb in micro_batches:
        # Scoring needs only the log-probs: no entropy pass over the [tokens, vocab] logits.
        result = module(mb.prompts, mb.nested(), with_entropy=False, **replayed_routes(mb))
        logps = mb.per_completion(result.logps.detach())
        setattr(mb, name, logps)
        if mb.weight:
            flat.extend(logps)
    return flat


def replayed_routes(mb: Groups, counts: ReplayCounts | None = None) -> dict:
    """The forward's options that replay ``mb``'s MoE routes (algo.routing_replay), counting into ``counts``; none
    when it carries no routes, so that a run without replay calls the forward exactly as before."""
    routes = mb.batch_routes
    return {} if routes is None else {"routes": routes._replace(counts=counts)}


def _full(t: Tensor) -> Tensor:
    """A plain tensor from a possibly sharded (DTensor) one."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
