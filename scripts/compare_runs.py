"""Compare two training runs' outputs: metrics.jsonl records equal except timing fields, completions.jsonl,
config.json and the final model's weights equal.  Usage: compare_runs.py DIR_A DIR_B"""
import hashlib
import json
import sys
from pathlib import Path

TIMING = ("time/",)                                   # phase seconds
TIMING_KEYS = {"tokens_per_s", "rollout_tokens_per_s"}  # generated tokens / those seconds


def timing(key: str) -> bool:
    return key.startswith(TIMING) or key in TIMING_KEYS


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(a: str, b: str) -> int:
    a, b = Path(a), Path(b)
    problems = []
    ra, rb = records(a / "metrics.jsonl"), records(b / "metrics.jsonl")
    if len(ra) != len(rb):
        problems.append(f"metrics.jsonl: {len(ra)} vs {len(rb)} records")
    compared = skipped = 0
    for i, (x, y) in enumerate(zip(ra, rb)):
        if x.keys() != y.keys():
            problems.append(f"record {i}: keys differ: {sorted(x.keys() ^ y.keys())}")
        for key in sorted(x.keys() & y.keys()):
            if timing(key):
                skipped += 1
                continue
            compared += 1
            if x[key] != y[key]:
                problems.append(f"record {i} (step {x.get('step')}): {key}: {x[key]!r} != {y[key]!r}")
    for name in ("completions.jsonl", "config.json", "inputs.json", "complete.json"):
        fa, fb = a / name, b / name
        if fa.exists() or fb.exists():
            ta = fa.read_text() if fa.exists() else None
            tb = fb.read_text() if fb.exists() else None
            if name == "config.json":  # the output folder is the one difference we ask for
                ta, tb = (json.dumps({**json.loads(t), "train": {**json.loads(t)["train"], "output_dir": "-"}})
                          if t else t for t in (ta, tb))
            if ta != tb:
                problems.append(f"{name} differs")
    weights = sorted((a / "final").glob("*.safetensors"))
    for wa in weights:
        wb = b / "final" / wa.name
        if not wb.exists() or hashlib.sha256(wa.read_bytes()).digest() != hashlib.sha256(wb.read_bytes()).digest():
            problems.append(f"final/{wa.name} differs")
    print(f"{a.name} vs {b.name}: {len(ra)} records, {compared} values equal-checked, {skipped} timing values "
          f"skipped, {len(weights)} final weight files checked: " + ("EQUAL" if not problems else "DIFFERENT"))
    for p in problems[:20]:
        print("   ", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
