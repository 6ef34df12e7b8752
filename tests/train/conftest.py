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


@pytest.fixture(autouse=True)
def single_thread():
    """Tiny models run fastest on one thread; with several, a busy 2-core machine spends its time in
    thread hand-offs (100x slower when other processes compete for the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
