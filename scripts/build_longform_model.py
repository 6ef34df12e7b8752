"""Build the long-form model shipped in turbogrpo/assets/longform_model/: tokenizer + warm-started policy.

What it makes (the recipe of scripts/build_demo_model.py, whose docstring gives the reasons, on the
long-form task of turbogrpo.data.longform; the shared code is scripts/shipped_model.py)
- The demo model (tokenizer and Qwen2-style policy: 8 layers, hidden 128, GQA 4/2 heads, tied
  embeddings, 1.6M parameters), allowed 512 positions (preamble ~220 + question <= ~130 + a 12-step
  solution ~101 tokens), fine-tuned by a short noisy supervised warm start on long-form problems.

Why the warm start is noisy on purpose: as for the demo model, a fraction of training steps is
written with the wrong operation, so greedy decoding is mostly right while sampling at temperature
1 often writes a wrong operation somewhere in a long solution; GRPO then has right and wrong
answers in a group to learn from. A solution has 3-12 steps, so the per-step noise is lower than
the demo's (0.1 against 0.3): a 12-step solution sampled with the demo's rate would nearly never be right.

STATUS (not shipped yet; no build so far is usable for GRPO):
- Attempts 1-2 (a numbered " Step k: a+b=c." format; 150 steps of 8 from the demo model at lr 1e-3,
  and at 3e-4): greedy 0 and 1 of 16 held-out problems.
- Attempt 3 (the task now writes the demo's own format, " 14+7=21 21-5=16 ...\\n#### 16", 3-12 steps):
  200 steps of 16 from the demo model (lr 1e-3, warm-up 10, --max-positions 512), then 450 steps of
  16 from that (--init-from it, --seed 1, lr 1e-3): completion loss 5.5 -> 0.93 (step 20) -> ~0.45
  (steps 300-450, flat), 375 + 691 s at 1 thread on the shared 2-core machine. Held-out (100
  problems, HF generate, max 128 new tokens): greedy 1%, pass@1 at temperature 1 2.5%, pass@4 9%
  (bench/results/longform_build_attempt.json). The model writes the right format and roughly the
  right number of steps, but does not copy the question's numbers (not even the start count).
  The same run at lr 2e-3 ended at the same loss and 0 of 24 greedy.
- Why warm-starting from the demo model does not help: the demo model is overfit to its own prompts.
  On a long-form prompt it writes nothing useful (greedy " 2", " 8", "12+3=3 ..." for 3-12 step
  questions), and even behind the demo's own preamble a 3-step question breaks it (it restates the
  question or answers 2 steps with the wrong start). Only the format carries over; reading a
  question of 3-12 sentences must be learnt anew.
- Next to try: a from-scratch build like the demo's (1,500 steps of 32; at ~1.2 s per step of 16 on
  one quiet core that is ~1 hour), or a demo model rebuilt on the arithmetic task with 2-5 steps so
  that it reads longer questions before the long-form fine-tune.
A build writes longform_info.json next to the model with its exact numbers and settings.

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
    max_positions=512,      # preamble + question + a 12-step solution is ~450 tokens
    steps=150,              # ~15 minutes on the shared 2-core machine (~6 s a step)
    batch_size=8,           # a batch of 8 problems is ~1,300 tokens after the shared preamble
    lr=1e-3,                # a quarter of the from-scratch rate: a fine-tune of the demo model
    warmup_steps=5,
    flip_op=0.1,            # per step; a solution has 3-12 steps
    length_buckets=16,      # solutions of 23-101 tokens: unsorted batches would be half padding
    num_eval=100,
    eval_samples=4,
    max_new_tokens=128,     # the longest reference solution is ~101 tokens
)

if __name__ == "__main__":
    main(TASK, DEFAULTS, __doc__.splitlines()[0])
