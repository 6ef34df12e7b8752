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

The shared machinery (tokenizer, model, warm start, evaluation) is scripts/shipped_model.py.

HYBRID (``--model demo-hybrid``: turbogrpo/assets/demo_hybrid_model/)
The same task, tokenizer (the demo's, read from its folder) and noisy recipe on a Qwen3.5-shaped model
(model type qwen3_5_text: 8 layers, gated DeltaNet in 6 and gated full attention in every 4th, hidden 128;
DeltaNet with 2 key and 4 value heads of 32, a convolution of 4). It is warm-started through turbogrpo's
shared-prefix forward (transformers' linear-attention cache cannot be repeated under autograd). Its
demo_info.json has the shipped build's settings and numbers. MEASURED, shipped build: seed 0, --threads 1,
1600 steps x 32 problems, 1,784,048 parameters; the warm start took 3468 s on the shared 2-core machine under load
4-15 (2 threads under that load were slower still: OpenMP's threads wait for each other when the cores are
oversubscribed). Held out, 200 problems x 8 samples, HF generate:
    pass@1 at temperature 1  53.0%     greedy  100%     pass@8  100%
An earlier build of 800 steps (2 threads) stopped at 5.4% / 10.5% / 32%: it still miscopied operands, and GRPO did
not visibly lift it in 80 steps.

Usage: .venv/bin/python scripts/build_demo_model.py [--model demo|demo-hybrid] [--out DIR] [--threads 2]
       [--steps N] ...
Reproducible: the same seed and thread count give the same weights, bit for bit (float summation
order depends on the number of threads; the shipped model is from --threads 1).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from shipped_model import BuildConfig, ShippedTask, main

from turbogrpo.data.arithmetic import PREAMBLE, generate_problems

REPO = Path(__file__).resolve().parents[1]

TASK = ShippedTask(
    name="demo", preamble=PREAMBLE, default_out=REPO / "turbogrpo" / "assets" / "demo_model",
    # Training problems may repeat (with fresh wording): 1500 x 32 is more than the number space.
    problems=lambda split, num, seed: generate_problems(split, num, seed=seed, distinct=split == "eval"))
# The shipped build's settings (BuildConfig's defaults are this model's).
DEFAULTS = BuildConfig()
# The hybrid's: the demo's tokenizer and recipe; fewer steps, so that the warm start fits ~15 minutes of a shared
# 2-core CPU (a DeltaNet step through transformers' torch kernels costs more than an attention step).
HYBRID_DEFAULTS = replace(DEFAULTS, architecture="qwen3_5", tokenizer_from="demo", steps=1600)
# The models this script builds, by the name `turbogrpo demo --model NAME` gives them.
VARIANTS = {
    "demo": (TASK, DEFAULTS),
    "demo-hybrid": (replace(TASK, default_out=REPO / "turbogrpo" / "assets" / "demo_hybrid_model"), HYBRID_DEFAULTS),
}

if __name__ == "__main__":
    chooser = argparse.ArgumentParser(add_help=False)
    chooser.add_argument("--model", choices=sorted(VARIANTS), default="demo")
    chosen, rest = chooser.parse_known_args()
    sys.argv[1:] = rest
    main(*VARIANTS[chosen.model], __doc__.splitlines()[0])
