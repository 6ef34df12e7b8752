"""Build the long-form model shipped in turbogrpo/assets/longform_model/: tokenizer + warm-started policy.

What it makes (the recipe of scripts/build_demo_model.py, whose docstring gives the reasons, on the
long-form task of turbogrpo.data.longform; the shared code is scripts/shipped_model.py)
- The demo model (tokenizer and Qwen2-style policy: 8 layers, hidden 128, GQA 4/2 heads, tied
  embeddings, 1.6M parameters), allowed 1024 positions (preamble + question + a 12-step solution is
  ~700 tokens), fine-tuned by a short noisy supervised warm start on long-form problems.

Why start from the demo model: it already knows the verbs, the numbers (2-digit totals, 1-digit
amounts) and their sums, and writes the same working; only the numbered lines and the count of
steps are new. A from-scratch build (4 layers, 400 steps of 16) needed more than 25 s a step on
the shared 2-core machine, hours in all; a solution that restated each question sentence before
its working (~16 tokens a step) was not learnt in 250 fine-tuning steps of 8 (greedy 1/16).

Why the warm start is noisy on purpose: as for the demo model, a fraction of training steps is
written with the wrong operation, so greedy decoding is mostly right while sampling at temperature
1 often writes a wrong operation somewhere in a long solution; GRPO then has right and wrong
answers in a group to learn from. A solution has 3-12 steps, so the per-step noise is lower than
the demo's (0.1 against 0.3): a 12-step solution sampled with the demo's rate would nearly never be right.

STATUS (not shipped yet): on the shared 2-core machine (load average 13-17) these defaults (150
steps of 8 from the demo model, lr 1e-3) ended at completion loss 0.70 and a model that no longer
copies the question's numbers (greedy 0 of 16 held-out problems): the first steps' loss (11 nats,
the demo model never wrote "Step k:" lines) wiped out what it knew. --lr 3e-4 --warmup-steps 10
was worse (loss 1.2-1.4, greedy 1 of 16, degenerate text). Next to try on quiet cores: a from-scratch
build (~1,000+ steps), or a warm start that first teaches only the new tokens (" Step", ":", "."). A build writes longform_info.json
next to the model with its exact numbers and settings.

Usage: .venv/bin/python scripts/build_longform_model.py [--out DIR] [--threads 2] [--steps N] ...
Reproducible: the same seed and thread count give the same weights, bit for bit.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from shipped_model import BuildConfig, ShippedTask, main

from turbogrpo.data.longform import PREAMBLE, generate_longform_problems

REPO = Path(__file__).resolve().parents[1]

TASK = ShippedTask(name="longform", preamble=PREAMBLE, default_out=REPO / "turbogrpo" / "assets" / "longform_model",
                   problems=lambda split, num, seed: generate_longform_problems(split, num, seed=seed))
DEFAULTS = replace(
    BuildConfig(),
    init_from="demo",       # the demo model knows the verbs, the numbers and their sums: only the format is new
    max_positions=1024,     # preamble + question + a 12-step solution is ~700 tokens
    steps=150,              # ~15 minutes on the shared 2-core machine (~6 s a step)
    batch_size=8,           # a batch of 8 problems is ~1,300 tokens after the shared preamble
    lr=1e-3,                # a quarter of the from-scratch rate: a fine-tune of the demo model
    warmup_steps=5,
    flip_op=0.1,            # per step; a solution has 3-12 steps
    length_buckets=16,      # solutions of 60-230 tokens: unsorted batches would be half padding
    num_eval=100,
    eval_samples=4,
    max_new_tokens=256,     # the longest reference solution is ~230 tokens
)

if __name__ == "__main__":
    main(TASK, DEFAULTS, __doc__.splitlines()[0])
