"""Held-out greedy and sampled accuracy of a demo-task model, split by one-digit vs two-digit starts.

Why: the demo's greedy accuracy falls under GRPO while sampled accuracy rises; this shows where the
greedy answers go wrong (prints JSON with both splits and every greedy failure).

Usage: .venv/bin/python scripts/demo_greedy_split.py MODEL_FOLDER  (4 samples per problem, seed 0)
"""

import json
import sys

import torch
from shipped_model import correct, generate

from turbogrpo.data.arithmetic import generate_problems
from turbogrpo.models import load_model_and_tokenizer

SAMPLES = 4


def main(path: str) -> dict:
    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer(path)
    problems = generate_problems("eval", 200, seed=0)
    greedy, sampled, texts = [], [], []
    for i in range(0, len(problems), 100):
        chunk = problems[i:i + 100]
        chunk_texts = generate(model, tokenizer, [p.prompt for p in chunk], num_samples=1, do_sample=False,
                               max_new_tokens=32)
        texts += chunk_texts
        greedy += correct(chunk_texts, chunk)
    for i in range(0, len(problems), 16):
        chunk = problems[i:i + 16]
        chunk_texts = generate(model, tokenizer, [p.prompt for p in chunk], num_samples=SAMPLES, do_sample=True,
                               max_new_tokens=32)
        sampled += [sum(correct(chunk_texts[j * SAMPLES:(j + 1) * SAMPLES], [p] * SAMPLES)) / SAMPLES
                    for j, p in enumerate(chunk)]
    splits = {"one_digit_start": lambda p: p.start < 10, "two_digit_start": lambda p: p.start >= 10,
              "all": lambda p: True}
    result = {}
    for name, keep in splits.items():
        index = [i for i, p in enumerate(problems) if keep(p)]
        result[name] = {"n": len(index), "greedy": sum(greedy[i] for i in index) / len(index),
                        "sampled": sum(sampled[i] for i in index) / len(index)}
    result["greedy_failures"] = [(problems[i].start, problems[i].changes, texts[i])
                                 for i in range(len(problems)) if not greedy[i]]
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(main(sys.argv[1]), indent=1))
