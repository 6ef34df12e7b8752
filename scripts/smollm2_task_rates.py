"""Base rates of candidate tasks for SmolLM2-135M-Instruct: how often it is right before any training.

GRPO needs groups that mix right and wrong answers, so a task it can learn on starts between about 10%
and 60% sampled success. Each candidate is asked zero-shot in chat (the model's template), greedy and
sampled (G=4) at temperatures 0.7 and 1, up to 48 new tokens, stopping at <|im_end|>. Writes
bench/results/smollm2_task_rates.json.

    python scripts/smollm2_task_rates.py [--num 48]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from harness import write_results  # noqa: E402

from turbogrpo.data.small_arithmetic import small_arithmetic_records  # noqa: E402
from turbogrpo.models import load_model_and_tokenizer  # noqa: E402
from turbogrpo.rewards import math_accuracy_reward  # noqa: E402
from turbogrpo.rollout import SamplingConfig, generate  # noqa: E402

TOPICS = ["the ocean", "a cat", "winter", "the moon", "coffee", "a bicycle", "music", "a forest", "rain",
          "the city", "a dog", "bread"]
KEYWORDS = ["blue", "quiet", "river", "happy", "golden", "small"]
MATH = math_accuracy_reward()


def single_digit(rng):
    a, b, op = rng.randint(1, 9), rng.randint(1, 9), rng.choice("+-")
    a, b = (max(a, b), min(a, b)) if op == "-" else (a, b)
    return f"What is {a} {op} {b}? Reply with only the number.", str(a + b if op == "+" else a - b)


# Candidates: name -> (make(rng, index) -> (question, gold), score(completion, gold) -> 0/1).
CANDIDATES = {
    "small_arithmetic (shipped, held-out split)": (
        lambda rng, i: (lambda row: (row["prompt"], row["answer"]))(small_arithmetic_records("eval", 331)[i]),
        lambda text, gold: MATH([None], [text], answer=[gold])[0]),
    "single-digit arithmetic": (lambda rng, i: single_digit(rng), lambda text, gold: MATH([None], [text], answer=[gold])[0]),
    "all capital letters": (
        lambda rng, i: (f"Write one short sentence about {rng.choice(TOPICS)} using only capital letters.", None),
        lambda text, gold: float(len(text.split()) >= 3 and not any(c.islower() for c in text))),
    "required keyword": (
        lambda rng, i: (lambda w: (f"Write one sentence about {rng.choice(TOPICS)} that uses the word \"{w}\".", w))(
            rng.choice(KEYWORDS)),
        lambda text, gold: float(re.search(rf"\b{gold}\b", text, re.I) is not None)),
    "exact word count": (
        lambda rng, i: (lambda n: (f"Describe {rng.choice(TOPICS)} in exactly {n} words.", n))(rng.randint(3, 7)),
        lambda text, gold: float(len(re.findall(r"[A-Za-z']+", text)) == gold)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num", type=int, default=48, help="questions per candidate")
    args = parser.parse_args()
    model, tokenizer = load_model_and_tokenizer("smollm2-135m-instruct")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    results = {}
    for name, (make, score) in CANDIDATES.items():
        rng = random.Random(0)
        items = [make(rng, i) for i in range(args.num)]
        prompts = [torch.tensor(tokenizer(tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False).input_ids) for q, _ in items]
        results[name] = {"example": items[0][0]}
        for temperature, num_samples in ((0.0, 1), (0.7, 4), (1.0, 4)):
            start = time.perf_counter()
            rollout = generate(model, prompts, num_samples=num_samples, seed=0, sampling=SamplingConfig(
                max_new_tokens=48, temperature=temperature, stop_token_ids=(end,)))
            scores = [score(tokenizer.decode(c, skip_special_tokens=True), gold)
                      for (_, gold), group in zip(items, rollout.tokens_per_group()) for c in group]
            rate = sum(scores) / len(scores)
            results[name][f"temperature_{temperature}"] = {"success": rate, "num_scored": len(scores)}
            print(f"{name:45s} T={temperature}: {rate:6.1%} of {len(scores)} ({time.perf_counter() - start:.0f} s)",
                  flush=True)
    write_results("smollm2_task_rates", {"model": "smollm2-135m-instruct", "questions_per_candidate": args.num,
                                         "max_new_tokens": 48, "candidates": results,
                                         "chosen": "small_arithmetic (shipped, held-out split)"})


if __name__ == "__main__":
    main()
