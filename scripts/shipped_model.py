"""What the build scripts of the shipped models share: tokenizer, model, noisy warm start, evaluation, CLI.

scripts/build_demo_model.py (the arithmetic task) and scripts/build_longform_model.py (the long-form
task) each describe their task with a ``ShippedTask`` and their defaults with a ``BuildConfig``, then
call ``main``. Their docstrings give the recipe's reasons and the shipped builds' numbers.

Problems are any ``turbogrpo.data.arithmetic.ArithmeticProblem`` (the long-form task's subclass too):
a prompt, a start and signed changes, and ``solution_text(steps)`` that writes out a list of steps.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import NamedTuple
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import (PreTrainedModel, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer, Qwen3_5ForCausalLM,
                          Qwen3_5TextConfig)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_PRETOKENIZE_REGEX

from turbogrpo.data.arithmetic import ArithmeticProblem, SolutionStep, question_block
from turbogrpo.models import load_model_and_tokenizer, resolve_model_path
from turbogrpo.prefix import completion_logprobs
from turbogrpo.rewards import math_accuracy

EOS, PAD = "<|endoftext|>", "<|pad|>"


@dataclass
class BuildConfig:
    """The knobs of a shipped model's build (each script sets its own defaults)."""

    seed: int = 0
    init_from: str = ""              # "" trains from scratch; a shipped model's name ("demo") or a folder: start there
    architecture: str = "qwen2"      # a key of ARCHITECTURES: the model built from scratch and how it is warm-started
    tokenizer_from: str = ""         # "" trains a tokenizer; a shipped model's name or a folder: reuse its tokenizer
    full_attention_every: int = 4    # hybrids: every 4th layer is full attention, the others linear (Qwen3.5's 3:1)
    vocab_size: int = 512            # 256 byte tokens + merges for the task's words
    hidden_size: int = 128
    num_layers: int = 8              # deep enough that a one-layer draft head is cheap next to it
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_positions: int = 512         # longest prompt + completion the model is built for
    steps: int = 1500                # arithmetic is learnt around steps 300-1000; stop before it is perfect
    batch_size: int = 32
    lr: float = 4e-3                 # high for a from-scratch tiny model; cosine-decayed to 0
    warmup_steps: int = 30
    question_loss: float = 1.0       # weight of the loss on question tokens: teaches copying names/numbers
    flip_op: float = 0.3             # P(a solution step is written with the wrong operation)
    length_buckets: int = 1          # batch problems of similar length, within windows of this many batches (1: off)
    num_eval: int = 200              # held-out problems for the numbers below
    eval_samples: int = 8            # samples per problem for pass@1 (temperature 1) and pass@k
    max_new_tokens: int = 32


@dataclass(frozen=True)
class ShippedTask:
    """A task a shipped model is built for."""

    name: str                        # "demo": writes demo_info.json next to the model
    preamble: str                    # the shared few-shot prefix of every prompt
    problems: Callable[[str, int, int], list[ArithmeticProblem]]  # (split, num, seed) -> problems
    default_out: Path


# ------------------------------------------------------------------ tokenizer and model

def build_tokenizer(task: ShippedTask, problems: list[ArithmeticProblem], vocab_size: int,
                    max_positions: int) -> Qwen2Tokenizer:
    """A byte-level BPE tokenizer trained on the task's text with Qwen2's pre-tokenizer (every
    digit is its own token), as a Qwen2Tokenizer so ``AutoTokenizer`` rebuilds exactly this one."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([task.preamble] + [question_block(p.question) + p.completion for p in problems],
                                  trainer)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(tokenizer.to_str())["model"]["merges"]]
    return Qwen2Tokenizer(vocab=tokenizer.get_vocab(), merges=merges, unk_token=None, eos_token=EOS,
                          pad_token=PAD, padding_side="left", model_max_length=max_positions)


def build_qwen2(config: BuildConfig, tokenizer) -> Qwen2ForCausalLM:
    """A Qwen2-style decoder: every layer softmax attention (the shipped demo model)."""
    model_config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, max_position_embeddings=config.max_positions,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    return Qwen2ForCausalLM(model_config)


def build_qwen3_5(config: BuildConfig, tokenizer) -> Qwen3_5ForCausalLM:
    """A Qwen3.5-shaped hybrid (model type qwen3_5_text): gated DeltaNet layers, and full attention (gated, with
    q/k norms) in every ``full_attention_every``-th layer. As in Qwen3.5, the linear layers have twice as many
    value heads as key heads and a convolution of width 4; all heads are ``hidden_size // num_heads`` wide."""
    head_dim = config.hidden_size // config.num_heads
    layer_types = ["full_attention" if (i + 1) % config.full_attention_every == 0 else "linear_attention"
                   for i in range(config.num_layers)]
    model_config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, layer_types=layer_types, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=head_dim, linear_num_key_heads=config.num_kv_heads,
        linear_num_value_heads=2 * config.num_kv_heads, linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim, linear_conv_kernel_dim=4, max_position_embeddings=config.max_positions,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    return Qwen3_5ForCausalLM(model_config)


def initial_tokenizer(task: "ShippedTask", config: BuildConfig):
    """``config.tokenizer_from``'s tokenizer (a shipped model's, so that two shipped models read the same ids), else
    one trained on the task's text."""
    if config.tokenizer_from:
        _, tokenizer = load_model_and_tokenizer(resolve_model_path(config.tokenizer_from))
        return tokenizer
    return build_tokenizer(task, task.problems("train", 3000, config.seed + 1), config.vocab_size,
                           config.max_positions)


def initial_model(config: BuildConfig):
    """(model, tokenizer) of ``config.init_from`` (its architecture and tokenizer, not the config's),
    allowed ``config.max_positions`` positions (rotary positions extend past the trained ones)."""
    model, tokenizer = load_model_and_tokenizer(resolve_model_path(config.init_from))
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, config.max_positions)
    tokenizer.model_max_length = max(tokenizer.model_max_length, config.max_positions)
    return model, tokenizer


# ------------------------------------------------------------------ warm start

def noisy_completion(problem: ArithmeticProblem, rng: random.Random, flip_op: float) -> str:
    """The reference working, except that each step's operation is flipped with probability
    ``flip_op`` (the step's result, and everything after it, follow the written operation)."""
    steps, total = [], problem.start
    for change in problem.changes:
        op = "+" if change > 0 else "-"
        if rng.random() < flip_op and total - abs(change) >= 0:
            op = "-" if op == "+" else "+"
        result = total + abs(change) if op == "+" else total - abs(change)
        steps.append(SolutionStep(total, op, abs(change), result))
        total = result
    return problem.solution_text(steps)


def shared_prefix_ids(tokenizer, problems: list[ArithmeticProblem]) -> list[int]:
    """The token ids every prompt starts with (the preamble), read off real tokenizations."""
    token_lists = [tokenizer(p.prompt)["input_ids"] for p in problems[:64]]
    length = 0
    while all(len(t) > length and t[length] == token_lists[0][length] for t in token_lists):
        length += 1
    return token_lists[0][:length]


def encode_batch(tokenizer, problems, completions, prefix_len: int):
    """ids [B, T]: prompt after the shared prefix + completion + eos, right-padded;
    completion_mask / question_mask [B, T]: which positions are targets of each kind."""
    seqs, prompt_lens = [], []
    for problem, completion in zip(problems, completions):
        prompt_ids = tokenizer(problem.prompt)["input_ids"][prefix_len:]
        seqs.append(prompt_ids + tokenizer(completion)["input_ids"] + [tokenizer.eos_token_id])
        prompt_lens.append(len(prompt_ids))
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    completion_mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    question_mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, (seq, prompt_len) in enumerate(zip(seqs, prompt_lens)):
        ids[i, :len(seq)] = torch.tensor(seq)
        completion_mask[i, prompt_len:len(seq)] = True
        question_mask[i, :prompt_len] = True
    return ids, completion_mask, question_mask


def sft_loss_cached(model, prefix, ids, completion_mask, question_mask, question_weight: float):
    """(loss to minimise, completion-token loss); the preamble runs once, its KV repeated per row."""
    prefix_out = model(prefix[None], use_cache=True)
    cache = prefix_out.past_key_values
    cache.batch_repeat_interleave(ids.shape[0])
    suffix_logits = model(ids, past_key_values=cache).logits
    logits = torch.cat([prefix_out.logits[:, -1:].expand(ids.shape[0], -1, -1), suffix_logits[:, :-1]], 1)
    token_loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none").view(ids.shape)
    return _weighted(token_loss, completion_mask, question_mask, question_weight)


def sft_loss_shared_prefix(model, prefix, ids, completion_mask, question_mask, question_weight: float):
    """``sft_loss_cached``'s loss through turbogrpo's shared-prefix forward: the preamble is the prompt of one group
    whose "completions" are the rows (question + solution + eos). A hybrid needs it: transformers' linear-attention
    cache updates its states in place, which breaks the backward through a repeated cache."""
    lengths = (completion_mask | question_mask).sum(1).tolist()
    rows = [row[:n] for row, n in zip(ids, lengths)]
    logps = completion_logprobs(model, [prefix], [rows], backend="cascade")[0]
    token_loss = -torch.nn.utils.rnn.pad_sequence(logps, batch_first=True)
    token_loss = F.pad(token_loss, (0, ids.shape[1] - token_loss.shape[1]))
    return _weighted(token_loss, completion_mask, question_mask, question_weight)


def _weighted(token_loss, completion_mask, question_mask, question_weight: float):
    """(completion loss + question_weight * question loss, completion loss), each a mean over its tokens [B, T]."""
    completion_loss = (token_loss * completion_mask).sum() / completion_mask.sum()
    question_loss = (token_loss * question_mask).sum() / question_mask.sum()
    return completion_loss + question_weight * question_loss, completion_loss


class ShippedArchitecture(NamedTuple):
    """How a shipped model of one architecture is built from scratch and warm-started."""

    build: Callable[[BuildConfig, object], PreTrainedModel]   # (config, tokenizer) -> a fresh model
    sft_loss: Callable                                         # sft_loss_cached's signature and result


# The demo keeps its cached loss (same values, other float rounding: its shipped weights are reproducible bit for bit).
ARCHITECTURES: dict[str, ShippedArchitecture] = {
    "qwen2": ShippedArchitecture(build_qwen2, sft_loss_cached),
    "qwen3_5": ShippedArchitecture(build_qwen3_5, sft_loss_shared_prefix),
}


def bucket_by_length(problems: list[ArithmeticProblem], batch_size: int, window: int,
                     rng: random.Random) -> list[ArithmeticProblem]:
    """``problems`` reordered so that each run of ``batch_size`` holds problems of similar length
    (less padding: a right-padded batch costs its longest row times its size): within each window
    of ``window`` batches, sort by length, cut into batches, and shuffle the batches' order."""
    if window <= 1:
        return problems
    ordered = []
    span = window * batch_size
    for i in range(0, len(problems), span):
        by_length = sorted(problems[i:i + span], key=lambda p: len(p.question) + len(p.completion))
        batches = [by_length[j:j + batch_size] for j in range(0, len(by_length), batch_size)]
        rng.shuffle(batches)
        ordered += [p for batch in batches for p in batch]
    return ordered


def warm_start(task: ShippedTask, model, tokenizer, config: BuildConfig, log_every: int = 100) -> None:
    """Supervised training from scratch on noisy solutions (AdamW, linear warm-up, cosine to 0)."""
    rng = random.Random(config.seed)
    problems = bucket_by_length(task.problems("train", config.steps * config.batch_size, config.seed),
                                config.batch_size, config.length_buckets, random.Random(f"buckets:{config.seed}"))
    prefix = torch.tensor(shared_prefix_ids(tokenizer, problems))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.01, betas=(0.9, 0.98))

    def lr_factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / (config.steps - config.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    sft_loss = ARCHITECTURES[config.architecture].sft_loss
    start = time.time()
    for step in range(config.steps):
        batch = problems[step * config.batch_size:(step + 1) * config.batch_size]
        completions = [noisy_completion(p, rng, config.flip_op) for p in batch]
        loss, completion_loss = sft_loss(model, prefix, *encode_batch(tokenizer, batch, completions, len(prefix)),
                                         config.question_loss)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == config.steps - 1:
            print(f"step {step:5d}  completion loss {completion_loss.item():.4f}  {time.time() - start:6.1f}s",
                  flush=True)
    model.eval()


# ------------------------------------------------------------------ evaluation

@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], *, num_samples: int, do_sample: bool,
             max_new_tokens: int) -> list[str]:
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    # transformers 5 applies no top-k / top-p unless asked: this samples the full distribution.
    out = model.generate(**batch, do_sample=do_sample, temperature=1.0 if do_sample else None,
                         num_return_sequences=num_samples, max_new_tokens=max_new_tokens,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)


def correct(texts: list[str], problems: list[ArithmeticProblem]) -> list[bool]:
    return [r == 1.0 for r in math_accuracy([""] * len(texts), texts, answer=[p.answer for p in problems])]


def evaluate(task: ShippedTask, model, tokenizer, config: BuildConfig) -> dict:
    """pass@1 at temperature 1 (mean over samples), greedy accuracy and pass@k on held-out problems,
    and the median time of one HF generate call making 64 completions (64 // k prompts x k samples)."""
    problems = task.problems("eval", config.num_eval, config.seed)
    k = config.eval_samples
    prompts_per_call = max(1, 64 // k)
    sampled, seconds = [], []
    for i in range(0, len(problems), prompts_per_call):
        chunk = problems[i:i + prompts_per_call]
        start = time.perf_counter()
        texts = generate(model, tokenizer, [p.prompt for p in chunk], num_samples=k, do_sample=True,
                         max_new_tokens=config.max_new_tokens)
        seconds.append(time.perf_counter() - start)
        sampled += [correct(texts[j * k:(j + 1) * k], [p] * k) for j, p in enumerate(chunk)]
    greedy = []
    for i in range(0, len(problems), 64):
        chunk = problems[i:i + 64]
        greedy += correct(generate(model, tokenizer, [p.prompt for p in chunk], num_samples=1, do_sample=False,
                                   max_new_tokens=config.max_new_tokens), chunk)
    return {
        "num_problems": len(problems),
        "pass@1_temperature1": sum(map(sum, sampled)) / (len(sampled) * k),
        "greedy_accuracy": sum(greedy) / len(greedy),
        f"pass@{k}_temperature1": sum(map(any, sampled)) / len(sampled),
        "seconds_per_generate_of_64_completions": sorted(seconds)[len(seconds) // 2],
        "prompt_tokens_mean": sum(len(tokenizer(p.prompt)["input_ids"]) for p in problems) / len(problems),
        "example": {"question": problems[0].question, "reference": problems[0].completion,
                    "samples": generate(model, tokenizer, [problems[0].prompt], num_samples=4, do_sample=True,
                                        max_new_tokens=config.max_new_tokens)},
    }


# ------------------------------------------------------------------ command line

def main(task: ShippedTask, defaults: BuildConfig, description: str) -> None:
    """Parse ``--out``, ``--threads`` and every BuildConfig field (``defaults`` as defaults), then
    build: tokenizer, model, warm start, save, evaluate, ``<task.name>_info.json``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=task.default_out)
    parser.add_argument("--threads", type=int, default=2)
    for field in fields(BuildConfig):
        default = getattr(defaults, field.name)
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(default), default=default)
    args = parser.parse_args()
    config = replace(defaults, **{f.name: getattr(args, f.name) for f in fields(BuildConfig)})
    torch.set_num_threads(args.threads)
    torch.manual_seed(config.seed)

    if config.architecture not in ARCHITECTURES:
        parser.error(f"--architecture {config.architecture!r} is not one of {sorted(ARCHITECTURES)}")
    if config.init_from:
        model, tokenizer = initial_model(config)
    else:
        tokenizer = initial_tokenizer(task, config)
        model = ARCHITECTURES[config.architecture].build(config, tokenizer)
    print(f"vocab {len(tokenizer)}, parameters {sum(p.numel() for p in model.parameters()):,}", flush=True)
    start = time.time()
    warm_start(task, model, tokenizer, config, log_every=max(1, config.steps // 20))
    warm_start_seconds = time.time() - start
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"saved to {args.out}; evaluating", flush=True)
    metrics = evaluate(task, model, tokenizer, config)
    info = {"build_config": asdict(config), "threads": args.threads, "warm_start_seconds": warm_start_seconds,
            "held_out_before_grpo": metrics}
    (args.out / f"{task.name}_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))
