"""Training on multi-turn conversations: environment ids sit in the completions but never reach the loss,
the KL, TIS, the entropy or the token counts; the shared-prefix forward still gives each conversation's
log-probs and gradients exactly (float64)."""

from dataclasses import replace

import pytest
import torch

from turbogrpo.algo import LOSSES, LossNormalizer, build_loss
from turbogrpo.batch import Groups, pad_ragged
from turbogrpo.config import AlgoConfig
from turbogrpo.placement import DistInfo
from turbogrpo.prefix import compute_logprobs
from turbogrpo.train.distributed import LogprobModule
from turbogrpo.train.update import update_policy

from .conftest import exact_tiny_model

SINGLE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
VOCAB = 64
# Per conversation: the lengths of its segments, model and environment alternating (model first).
SEGMENTS = [[[3, 4, 2], [5], [2, 6, 1, 3, 2]], [[4, 2, 3], [1, 5, 2, 1, 4]]]


def multiturn_batch(seed: int = 0) -> Groups:
    """Two groups of conversations whose completions interleave model and environment segments, with
    random advantages and old / reference / sampler log-probs (garbage-free only on model tokens)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (p,), generator=gen) for p in (7, 4)]
    completions, masks = [], []
    for group in SEGMENTS:
        completions.append([])
        masks.append([])
        for segments in group:
            mask = torch.cat([torch.full((n,), j % 2 == 0) for j, n in enumerate(segments)])
            completions[-1].append(torch.randint(0, VOCAB, (len(mask),), generator=gen))
            masks[-1].append(mask)
    lengths = [len(m) for group in masks for m in group]

    def logps():
        return [-torch.rand(n, generator=gen, dtype=torch.float64) * 3 for n in lengths]

    advantages = torch.randn(len(lengths), generator=gen, dtype=torch.float64)
    return Groups(prompts, [c for g in completions for c in g], [len(g) for g in completions],
                  advantages=advantages, old_logps=logps(), ref_logps=logps(), sampler_logps=logps(),
                  model_mask=[m for g in masks for m in g])


def with_garbage_on_env_tokens(batch: Groups, seed: int) -> Groups:
    """The batch with every per-token field replaced by other values where model_mask is 0."""
    gen = torch.Generator().manual_seed(seed)

    def spoil(rows):
        return [torch.where(m, r, torch.randn(r.shape, generator=gen, dtype=r.dtype) * 5 - 10)
                for r, m in zip(rows, batch.model_mask)]
    return replace(batch, old_logps=spoil(batch.old_logps), ref_logps=spoil(batch.ref_logps),
                   sampler_logps=spoil(batch.sampler_logps))


def one_sequence_logps(model, batch: Groups) -> list[torch.Tensor]:
    """Each conversation as one plain sequence (no sharing): log-probs of its completion ids."""
    out = []
    for g, prompt in enumerate(batch.prompts):
        for i in batch.positions(g):
            ids = torch.cat([prompt, batch.completions[i]])
            logits = model(ids[None]).logits[0, len(prompt) - 1:-1]
            out.append(logits.log_softmax(-1).gather(-1, batch.completions[i][:, None])[:, 0])
    return out


def masked_loss(logps: list[torch.Tensor], batch: Groups) -> torch.Tensor:
    """sum over model tokens of A_i * logp (a loss whose gradient shows any env-token leak)."""
    return sum((lp * m * a).sum() for lp, m, a in zip(logps, batch.model_mask, batch.advantages))


def test_shared_prefix_logprobs_and_gradients_equal_one_sequence_per_conversation():
    batch = multiturn_batch()
    model = exact_tiny_model(vocab=VOCAB)
    shared = batch.per_completion(compute_logprobs(model, batch.prompts, batch.nested()).logps)
    reference = one_sequence_logps(model, batch)
    for a, b in zip(shared, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    params = list(model.parameters())
    grads_shared = torch.autograd.grad(masked_loss(shared, batch), params)
    grads_reference = torch.autograd.grad(masked_loss(one_sequence_logps(model, batch), batch), params)
    for a, b in zip(grads_shared, grads_reference):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def model_tokens_only(batch: Groups, logps: list[torch.Tensor]):
    """The reference layout: each conversation's model tokens packed into one row, env tokens removed."""
    def keep(rows):
        return pad_ragged([r[m] for r, m in zip(rows, batch.model_mask)])
    return (keep(logps), keep(batch.old_logps), keep(batch.ref_logps), keep(batch.sampler_logps),
            pad_ragged([torch.ones(int(m.sum()), dtype=torch.float64) for m in batch.model_mask]))


@pytest.mark.parametrize("loss_name", sorted(LOSSES))
def test_every_loss_with_kl_and_tis_sees_model_tokens_only(loss_name):
    """Loss, gradient and metrics equal the same loss on the model tokens alone (env tokens cut out), and
    do not change when every per-token field holds garbage on the env tokens."""
    settings = AlgoConfig(loss=loss_name, beta=0.1, tis_cap=2.0, kl_bias_correction=True)
    loss_fn = build_loss(settings)
    batch = multiturn_batch(seed=1)
    model = exact_tiny_model(vocab=VOCAB)
    params = list(model.parameters())

    def run(b: Groups):
        logps = b.per_completion(compute_logprobs(model, b.prompts, b.nested()).logps)
        mask = b.mask(torch.device("cpu"))
        normalizer = LossNormalizer.for_batch(mask, max_completion_length=16)
        loss, metrics = loss_fn(pad_ragged(logps), b.padded("old_logps"), b.padded("ref_logps"), b.advantages,
                                mask, normalizer, rollout_logps=b.padded("sampler_logps"))
        return loss, metrics, torch.autograd.grad(loss, params, retain_graph=True), logps

    loss, metrics, grads, logps = run(batch)
    spoiled_loss, spoiled_metrics, spoiled_grads, _ = run(with_garbage_on_env_tokens(batch, seed=2))
    logps_BL, old_BL, ref_BL, sampler_BL, mask_BL = model_tokens_only(batch, logps)
    ref_loss, ref_metrics = loss_fn(logps_BL, old_BL, ref_BL, batch.advantages, mask_BL,
                                    LossNormalizer.for_batch(mask_BL, max_completion_length=16),
                                    rollout_logps=sampler_BL)
    ref_grads = torch.autograd.grad(ref_loss, params)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(spoiled_loss, loss, rtol=0, atol=0)
    for name in metrics:
        torch.testing.assert_close(metrics[name], ref_metrics[name], rtol=1e-12, atol=1e-14, msg=name)
        torch.testing.assert_close(spoiled_metrics[name], metrics[name], rtol=0, atol=0, msg=name)
    for a, b, c in zip(grads, ref_grads, spoiled_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(c, a, rtol=0, atol=0)
    assert mask_BL.sum() < batch.mask(torch.device("cpu")).numel()  # env tokens were there to leak


def test_update_counts_and_entropy_cover_model_tokens_only():
    """update_policy's token count and mean entropy are over the sampled tokens."""
    batch = multiturn_batch(seed=3)
    batch.old_logps = batch.ref_logps = batch.sampler_logps = None
    model = exact_tiny_model(vocab=VOCAB)
    mask = batch.mask(torch.device("cpu"))
    normalizer = LossNormalizer.for_batch(mask, max_completion_length=16)
    out = update_policy(LogprobModule(model, compute_logprobs), batch.micro_batches(30),
                        build_loss(AlgoConfig(loss="bnpo")), normalizer,
                        torch.optim.SGD(model.parameters(), lr=0.0), max_grad_norm=0.0, dist=SINGLE)
    with torch.no_grad():
        entropies = []
        for g, prompt in enumerate(batch.prompts):
            for i in batch.positions(g):
                ids = torch.cat([prompt, batch.completions[i]])
                logp = model(ids[None]).logits[0, len(prompt) - 1:-1].log_softmax(-1)
                entropies.append(-(logp.exp() * logp).sum(-1)[batch.model_mask[i]])
    expected = torch.cat(entropies).mean().item()
    assert out.metrics["entropy"] == pytest.approx(expected, rel=1e-9)
    assert sum(batch.trained_lengths) == int(mask.sum()) < sum(batch.lengths)


def test_model_mask_travels_through_select_pick_concat_and_micro_batches():
    batch = multiturn_batch()
    masks = [m.tolist() for m in batch.model_mask]
    assert [m.tolist() for m in batch.select([1]).model_mask] == masks[3:]
    assert [m.tolist() for m in batch.pick([[2], [0]]).model_mask] == [masks[2], masks[3]]
    assert [m.tolist() for m in Groups.concat([batch.group(1), batch.group(0)]).model_mask] == masks[3:] + masks[:3]
    flat = [m.tolist() for mb in batch.micro_batches(20) for m in mb.model_mask]
    assert flat == masks
    padded = batch.mask(torch.device("cpu"))
    for row, m in zip(padded, masks):
        assert row[:len(m)].tolist() == [float(v) for v in m] and not row[len(m):].any()
