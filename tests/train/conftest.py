import types

import pytest
import torch

from turbogrpo.models import tiny_model


def exact_tiny_model(seed: int = 3, vocab: int = 64):
    """A float64 tiny Qwen2 whose RMSNorms also compute in float64.

    Hugging Face RMSNorms compute in float32 even in a float64 model, which would round the
    differently summed gradients of two equivalent computations at float32 precision.
    """
    model = tiny_model("qwen2", vocab_size=vocab, hidden=32, layers=2, dtype="float64", seed=seed)

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(forward, module)
    return model


def random_step_batch(prompt_lengths, completion_lengths, *, vocab: int, seed: int, logp_center: float,
                      logp_spread: float):
    """A batch (``Groups``) of random prompts/completions of the given lengths, with random advantages and
    old/reference log-probs around ``logp_center`` (drawn in that order from one seeded generator)."""
    from turbogrpo.batch import Groups
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (p,), generator=gen) for p in prompt_lengths]
    completions = [[torch.randint(0, vocab, (s,), generator=gen) for s in group] for group in completion_lengths]
    advantages = torch.randn(sum(map(len, completion_lengths)), generator=gen, dtype=torch.float64)

    def logps():
        return [[torch.randn(s, generator=gen, dtype=torch.float64) * logp_spread + logp_center for s in group]
                for group in completion_lengths]
    old = logps()
    return Groups.from_nested(prompts, completions, advantages=advantages, old_logps=old, ref_logps=logps())


@pytest.fixture(autouse=True)
def single_thread():
    """Tiny models run fastest on one thread; with several, a busy 2-core machine spends its time in
    thread hand-offs (100x slower when other processes compete for the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
