"""GPU row of the TRL drop-in benchmark (called by bench/gpu.py): the 1.5B shape.

TRL's GRPOTrainer with and without turbogrpo.integrations.trl, on a randomly initialised model of
Qwen2-1.5B's shape (hidden 1536, 28 layers, 12 query / 2 KV heads, intermediate 8960, vocab 151936)
in bfloat16 on CUDA, TRL with bf16=True (its default): training forward+backward and one whole TRL
step, 8 prompts x G=8, 512-token prompts, 128 new tokens (the shape of bench/trl_dropin.py).

``run(results, budget_s)`` fills ``results`` (bench/gpu.py's part "trl") with the measurements, or with
``status: "skipped"`` and the reason without CUDA, without a supported TRL, or with too small a budget.
Repeats beyond the first, and the whole step, run only while the budget allows (flex attention's
first compile and TRL's generation are the slow parts).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

QWEN2_1_5B_SHAPE = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                        num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                        tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)
# Below this there is no time for two model builds, two generations and one warm fwd+bwd pair.
MIN_BUDGET_S = 45.0


def qwen2_1_5b_shape():
    """A random Qwen2-1.5B-shaped model, built directly in bfloat16 on the GPU."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = Qwen2ForCausalLM(Qwen2Config(**QWEN2_1_5B_SHAPE))
    finally:
        torch.set_default_dtype(default_dtype)
    return model


def skip_reason(budget_s: float) -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        from turbogrpo.integrations.trl import check_trl_version
        check_trl_version()
    except (ImportError, ValueError) as err:
        return f"TRL unavailable: {err}"
    if budget_s < MIN_BUDGET_S:
        return f"budget {budget_s:.0f}s is below the {MIN_BUDGET_S:.0f}s this row needs"
    return None


def run(results: dict, budget_s: float) -> None:
    """Fill ``results`` with the 1.5B-shape TRL drop-in row (or why it was skipped)."""
    reason = skip_reason(budget_s)
    if reason is not None:
        results.update(status="skipped", reason=reason)
        print(f"[trl] skipped: {reason}", flush=True)
        return
    from trl_dropin import measure, print_result, word_tokenizer
    torch.cuda.reset_peak_memory_stats()
    result = measure(qwen2_1_5b_shape, word_tokenizer(QWEN2_1_5B_SHAPE["vocab_size"]), repeats=3,
                     step_repeats=2, warmup=1, budget_s=budget_s, bf16=True)
    print_result(f"TRL GRPOTrainer on {torch.cuda.get_device_name()}, Qwen2-1.5B shape, bf16", result)
    results.update(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   model={"shape": "Qwen2-1.5B", **QWEN2_1_5B_SHAPE}, dtype="bfloat16",
                   peak_memory_gb=torch.cuda.max_memory_allocated() / 2 ** 30, **result)
