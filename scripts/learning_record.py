"""A finished run's learning record for bench/results: held-out accuracy before and after with binomial
standard errors, the reward curve, time per step, and the run's report plots.

    python scripts/learning_record.py runs/smollm2_arithmetic smollm2_arithmetic_run
writes bench/results/<NAME>.json and copies the run's report/*.png as bench/results/<NAME>_*.png.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from harness import RESULTS_DIR, write_results  # noqa: E402


def rise(before: float, after: float, n: int) -> dict:
    """A change in a success rate measured on ``n`` scored answers each time, in standard errors of the
    difference of two independent binomial proportions."""
    se = math.sqrt(before * (1 - before) / n + after * (1 - after) / n)
    return {"before": before, "after": after, "num_scored": n, "se_of_difference": se,
            "rise_in_se": (after - before) / se if se else float("inf")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("name")
    args = parser.parse_args()
    config = json.loads((args.run_dir / "config.json").read_text())
    records = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in records if "eval/accuracy" in r]
    steps = [r for r in records if "reward" in r]
    num_problems = config["data"]["num_eval_problems"]
    num_samples = config["data"]["num_eval_samples"]
    first, last = evals[0], evals[-1]
    record = {
        "run": str(args.run_dir), "config": config,
        "eval_steps": [e["step"] for e in evals],
        "greedy": rise(first["eval/accuracy"], last["eval/accuracy"], num_problems),
        "sampled": rise(first["eval/sampled_accuracy"], last["eval/sampled_accuracy"], num_problems * num_samples),
        "reward_curve": [[r["step"], r["reward"]] for r in steps],
        "completion_length_curve": [[r["step"], r.get("completion_length/mean")] for r in steps],
        "seconds_per_step": [[r["step"], r.get("time/step")] for r in steps],
        "first_5_mean_reward": sum(r["reward"] for r in steps[:5]) / len(steps[:5]),
        "last_5_mean_reward": sum(r["reward"] for r in steps[-5:]) / len(steps[-5:]),
    }
    write_results(args.name, record)
    for png in sorted((args.run_dir / "report").glob("*.png")):
        shutil.copy(png, RESULTS_DIR / f"{args.name}_{png.name}")
        print(f"copied {png.name}")
    for kind in ("greedy", "sampled"):
        r = record[kind]
        print(f"held-out {kind}: {r['before']:.1%} -> {r['after']:.1%} (n={r['num_scored']}, "
              f"{r['rise_in_se']:+.1f} standard errors)")
    print(f"mean reward, first 5 steps {record['first_5_mean_reward']:.3f} -> last 5 {record['last_5_mean_reward']:.3f}")


if __name__ == "__main__":
    main()
