"""Speculation is lossless on the real model too: SmolLM2 on its arithmetic task, 32 held-out prompts x 8
samples per rollout, T=1, stop at <|im_end|> or 32 tokens; plain sampling against forced 4x3x8 trees of
the built GSM8K draft (``turbogrpo draft build --model smollm2``) on every decoding step. Compares the
completion-length distributions (two-sample chi-square, 99.9% bound).

    python scripts/smollm2_lossless_check.py 4     # 4 rollouts each -> bench/results/smollm2_lossless_check.json
"""
import sys, time, json, statistics, torch
sys.path.insert(0, ".")
from turbogrpo.config import load_config
from turbogrpo.rewards import build_rewards
from turbogrpo.train import distributed
from turbogrpo.train.run import build_run
from turbogrpo.rollout import generate
from turbogrpo.speculative import Speculation
from turbogrpo.speculative.sizing import FixedSizing
from turbogrpo.speculative.draft import DraftHead
from turbogrpo.speculative.built_drafts import resolve_draft_path
from turbogrpo.host_memory import keep_freed_host_memory
from bench.harness import machine_info
keep_freed_host_memory()
config = load_config("configs/smollm2_arithmetic.toml", ['train.output_dir="runs/lossless_check"', "log.tensorboard=false", "log.progress_bar=false"])
run = build_run(config, distributed.setup("cpu", "auto"), build_rewards(config.rewards))
draft = DraftHead.load(resolve_draft_path("smollm2-gsm8k"), run.policy)
examples = run.held_out.examples[:32]
prompts = [e.token_ids for e in examples]
out = {}
with torch.no_grad():
    for name, spec in (("plain", None), ("trees", Speculation(draft, FixedSizing((4, 3, 8))))):
        lengths, first, t0 = [], [], time.perf_counter()
        for seed in range(int(sys.argv[1]) if len(sys.argv) > 1 else 4):
            r = generate(run.policy, prompts, num_samples=8, sampling=run.sampling, seed=100 + seed, draft=spec)
            lengths += [len(t) for t in r.tokens]; first += [int(t[1]) for t in r.tokens if len(t) > 1]
            if spec is not None: acc = r.stats.mean_accepted_length
        out[name] = {"lengths": lengths, "second_tokens": first, "seconds": time.perf_counter() - t0}
        n = len(lengths); m = statistics.mean(lengths); sd = statistics.stdev(lengths)
        print(name, "n", n, "mean length %.2f (SE %.2f)" % (m, sd / n ** 0.5), "at cap", sum(l == run.sampling.max_new_tokens for l in lengths), "s %.0f" % out[name]["seconds"], "accept" if spec else "", acc if spec else "", flush=True)
a = torch.bincount(torch.tensor(out["plain"]["lengths"]), minlength=40).double(); b = torch.bincount(torch.tensor(out["trees"]["lengths"]), minlength=40).double()
seen = (a + b) > 0; stat = float(((a - b)[seen] ** 2 / (a + b)[seen]).sum()); dof = int(seen.sum()) - 1
print("length chi2", stat, "dof", dof, "99.9% bound", dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3)
bound = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3
summary = {name: {"completions": len(v["lengths"]), "mean_length": statistics.mean(v["lengths"]),
                  "at_cap": sum(l == run.sampling.max_new_tokens for l in v["lengths"]), "seconds": v["seconds"]}
           for name, v in out.items()}
json.dump({"machine": machine_info(), "summary": summary, "length_chi2": stat, "dof": dof, "bound_999": bound, "equal": stat < bound, **out},
          open("bench/results/smollm2_lossless_check.json", "w"), indent=1)
