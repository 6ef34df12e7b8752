"""Build the demo model shipped in turbogrpo/assets/demo_model/: tokenizer + warm-started policy.

What it makes
- A byte-level BPE tokenizer (vocab <= 512) trained on the arithmetic task's text with Qwen2's
  pre-tokenizer (every digit is its own token), saved as a Qwen2Tokenizer so ``AutoTokenizer``
  rebuilds exactly the tokenizer used here.
- A Qwen2-style model (8 layers, hidden 128, GQA 4/2 heads, tied embeddings, ~1.6M parameters),
  trained from scratch by a short supervised warm start on turbogrpo.data.arithmetic problems.

Why the warm start is noisy on purpose
GRPO can only reinforce answers the policy already samples. The warm start writes the wrong
operation ("+" for a loss, "-" for a gain) in a fraction of its training solutions, so the model
knows the method (greedy decoding is mostly right) but samples a wrong operation often at
temperature 1. Correct and wrong answers then both occur within a GRPO group, and a few minutes
of GRPO visibly raise sampled accuracy. The noise rates and training length are the knobs.

MEASURED (demo_info.json next to the model has the shipped build's exact numbers)
Shipped build: seed 0, --threads 1, 1500 steps x 32 problems, flip_op 0.3; 1,642,368 parameters,
vocabulary 510, prompts ~236 tokens of which the shared preamble is ~205. Held out, 200 eval
problems, 8 samples each, HF generate:
    pass@1 at temperature 1  37.6%     greedy  87.5%     pass@8  90.0%
    one HF generate call of 64 completions (8 prompts x 8, ~22 new tokens): 2.4-3.1 s (1 thread)
The warm start took 1591 s on a shared 2-core machine under heavy load (load average 4-9); a step
of 64 problems took ~0.55 s on 2 threads when the machine was quieter, so a rebuild on 2 quiet
cores should take roughly 8-10 minutes (estimate).
GRPO on it with the project's trainer (`turbogrpo demo`: 40 steps x 16 prompts x G=8, dapo loss,
lr 2e-4): held-out sampled accuracy 37.8% -> 62.0% (greedy 87.5% -> 80.5%).
Tuning history: clean labels (flip_op 0) give 16% / 31% / 67% (pass@1 / greedy / pass@8) after 600
steps and 45% / 78% / 97% after 1200, but plain GRPO (8 x 8, lr 3e-5 to 3e-4) did not raise that
model's accuracy within 50 steps: its errors are spread over arithmetic digits. Flipped operations
put most errors on two tokens per solution, which GRPO corrects quickly. Operands up to 99 were not
learnt in 600 steps (greedy 11%), hence operands 2-9 on totals up to 40.

Usage: .venv/bin/python scripts/build_demo_model.py [--out DIR] [--threads 2] [--steps N] ...
Reproducible: the same seed and thread count give the same weights, bit for bit (float summation
order depends on the number of threads; the shipped model is from --threads 1).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_PRETOKENIZE_REGEX

from turbogrpo.data.arithmetic import (PREAMBLE, ArithmeticProblem, SolutionStep, format_solution,
                                       generate_problems, question_block)
from turbogrpo.rewards import math_accuracy

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "turbogrpo" / "assets" / "demo_model"
EOS, PAD = "<|endoftext|>", "<|pad|>"


@dataclass
class BuildConfig:
    seed: int = 0
    vocab_size: int = 512            # 256 byte tokens + merges for the task's words
    hidden_size: int = 128
    num_layers: int = 8              # deep enough that a one-layer draft head is cheap next to it
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    steps: int = 1500                # arithmetic is learnt around steps 300-1000; stop before it is perfect
    batch_size: int = 32
    lr: float = 4e-3                 # high for a from-scratch tiny model; cosine-decayed to 0
    warmup_steps: int = 30
    question_loss: float = 1.0       # weight of the loss on question tokens: teaches copying names/numbers
    flip_op: float = 0.3             # P(a solution step is written with the wrong operation)
    num_eval: int = 200              # held-out problems for the numbers below
    eval_samples: int = 8            # samples per problem for pass@1 (temperature 1) and pass@k
    max_new_tokens: int = 32


# ------------------------------------------------------------------ tokenizer and model

def build_tokenizer(problems: list[ArithmeticProblem], vocab_size: int) -> Qwen2Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([PREAMBLE] + [question_block(p.question) + p.completion for p in problems],
                                  trainer)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(tokenizer.to_str())["model"]["merges"]]
    return Qwen2Tokenizer(vocab=tokenizer.get_vocab(), merges=merges, unk_token=None, eos_token=EOS,
                          pad_token=PAD, padding_side="left", model_max_length=512)


def build_model(config: BuildConfig, tokenizer: Qwen2Tokenizer) -> Qwen2ForCausalLM:
    model_config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return Qwen2ForCausalLM(model_config)


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
    return format_solution(steps)


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


def sft_loss(model, prefix, ids, completion_mask, question_mask, question_weight: float):
    """(loss to minimise, completion-token loss); the preamble runs once, its KV repeated per row."""
    prefix_out = model(prefix[None], use_cache=True)
    cache = prefix_out.cache
    cache.batch_repeat_interleave(ids.shape[0])
    suffix_logits = model(ids, cache=cache).logits
    logits = torch.cat([prefix_out.logits[:, -1:].expand(ids.shape[0], -1, -1), suffix_logits[:, :-1]], 1)
    token_loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none").view(ids.shape)
    completion_loss = (token_loss * completion_mask).sum() / completion_mask.sum()
    question_loss = (token_loss * question_mask).sum() / question_mask.sum()
    return completion_loss + question_weight * question_loss, completion_loss


def warm_start(model, tokenizer, config: BuildConfig, log_every: int = 100) -> None:
    rng = random.Random(config.seed)
    problems = generate_problems("train", config.steps * config.batch_size, seed=config.seed, distinct=False)
    prefix = torch.tensor(shared_prefix_ids(tokenizer, problems))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.01, betas=(0.9, 0.98))

    def lr_factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / (config.steps - config.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
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


def evaluate(model, tokenizer, config: BuildConfig) -> dict:
    """pass@1 at temperature 1 (mean over samples), greedy accuracy and pass@k on held-out problems,
    and the median time of one HF generate call making 64 completions (8 prompts x 8 samples)."""
    problems = generate_problems("eval", config.num_eval, seed=config.seed)
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--threads", type=int, default=2)
    for field in fields(BuildConfig):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
    args = parser.parse_args()
    config = BuildConfig(**{f.name: getattr(args, f.name) for f in fields(BuildConfig)})
    torch.set_num_threads(args.threads)
    torch.manual_seed(config.seed)

    tokenizer = build_tokenizer(generate_problems("train", 3000, seed=config.seed + 1, distinct=False),
                                config.vocab_size)
    model = build_model(config, tokenizer)
    print(f"vocab {len(tokenizer)}, parameters {sum(p.numel() for p in model.parameters()):,}", flush=True)
    start = time.time()
    warm_start(model, tokenizer, config)
    warm_start_seconds = time.time() - start
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    metrics = evaluate(model, tokenizer, config)
    info = {"build_config": asdict(config), "threads": args.threads, "warm_start_seconds": warm_start_seconds,
            "held_out_before_grpo": metrics}
    (args.out / "demo_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
