"""Tiny random models for the rollout tests (built from configs; nothing is downloaded)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, \
    Qwen2ForCausalLM

VOCAB = 64
ARCHITECTURES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def build_model(arch: str = "qwen2", *, vocab_size: int = VOCAB, seed: int = 0, **overrides):
    config_cls, model_cls = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    settings = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                    initializer_range=0.2, tie_word_embeddings=False)
    settings.update(overrides)
    return model_cls(config_cls(**settings)).eval()


def random_prompts(lengths, *, vocab_size: int = VOCAB, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator) for n in lengths]


@pytest.fixture(scope="module")
def qwen2():
    return build_model("qwen2")


@pytest.fixture(scope="module")
def llama():
    return build_model("llama", seed=1)


HOST_SYNCS = ("item", "tolist", "cpu", "nonzero", "__bool__", "__int__", "__float__", "numpy")
"""``torch.Tensor`` methods that wait for the device (``torch.nonzero`` is watched too)."""


def forbid_host_syncs_inside(monkeypatch, *functions: tuple[object, str]) -> None:
    """Make every host sync raise while one of ``functions`` (``(owner, attribute name)`` pairs,
    patched through ``monkeypatch``) runs: the check that a decoding step never waits for the device."""
    in_step = []

    def forbidden(name, original):
        def guarded(*args, **kwargs):
            if in_step:
                raise AssertionError(f"host sync inside a decoding step: {name}")
            return original(*args, **kwargs)
        return guarded

    for name in HOST_SYNCS:
        monkeypatch.setattr(torch.Tensor, name, forbidden(f"Tensor.{name}", getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "nonzero", forbidden("torch.nonzero", torch.nonzero))

    def watched(original):
        def run(*args, **kwargs):
            in_step.append(True)
            try:
                return original(*args, **kwargs)
            finally:
                in_step.pop()
        return run

    for owner, attribute in functions:
        monkeypatch.setattr(owner, attribute, watched(getattr(owner, attribute)))


@pytest.fixture(scope="module")
def demo():
    """The shipped demo model in float32 (eval mode) and its tokenizer, loaded once per module."""
    from turbogrpo.models import load_demo_model
    model, tokenizer = load_demo_model(dtype="float32")
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def vllm_llm():
    """ONE vLLM ``LLM`` of the shipped demo model in float32 for every vLLM test module of the session (a build
    takes 60-100 s on 2 CPU cores). Modules wrap it in their own ``VllmEngine(..., llm=vllm_llm)``, which pushes
    its policy's weights before its first rollout, and push their model back after a test that trained it."""
    from turbogrpo.models import load_demo_model
    from turbogrpo.engines.vllm import VllmEngine  # only vLLM modules (skipped without vllm) ask for this
    model, tokenizer = load_demo_model(dtype="float32")
    engine = VllmEngine(torch.float32, torch.device("cpu"), tokenizer)
    engine.build(model.eval())
    return engine.llm


@pytest.fixture(scope="session")
def vllm_kept():
    """Where a module puts a vLLM engine it built for itself, to keep it alive until the session ends: vLLM
    tears down the parallel groups every in-process engine shares when one of them is shut down, so an engine
    freed at its module's end would break the session's shared one (``vllm_llm``) in a later module of the same
    pytest worker (``VllmEngine``'s ``GROUPS_TORN_DOWN``)."""
    kept = []
    yield kept
    kept.clear()
