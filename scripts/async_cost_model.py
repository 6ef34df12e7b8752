"""The cost model of one GRPO step past one machine (docs/design/async.md): on-policy vs k = 1 vs k = 1 with
partial rollouts, at 8, 64 and 512 GPUs, from measured shapes (bench/results/*.json) and stated assumptions.

    python scripts/async_cost_model.py           # rewrite the table in docs/design/async.md
    python scripts/async_cost_model.py --check   # exit 1 if the committed table is not what this makes now

One step is rollout + weight push + update. With N GPUs, a fixed global batch, and the step at the base scale
(8 GPUs) split into a rollout share r and an update share 1 - r of T8 seconds:

    R(n) = r T8 max(8 / n, 1 / c)      rollout on n GPUs: shrinks with n until each GPU's batch falls under the
                                       decode knee (c = global batch / (8 x knee rows)); below it a decode step
                                       costs the same, so the rollout is the longest generation's decode steps
    U(n) = (1 - r) T8 8 / n            update on n GPUs: compute-bound, data-parallel, ideal (optimistic)
    on-policy (k = 0, colocated):      T0 = R(N) + U(N)        (the native engine samples with the trainer's
                                                                weights: nothing to push)
    k = 1 (rollout and update pools):  T1 = min over n_R of max(R(n_R), U(N - n_R)) + P
    k = 1 + partial rollouts:          the same with R scaled by u, the rollout's occupancy (mean / longest
                                       generation): a step no longer waits for its longest generation, which
                                       continues into the next step (its tokens keep their versions)

P, the weight push from the update pool to the rollout pool, is paid once per step on the critical path (the
rollout pool cannot draw version v + 1 before it has it) and does not grow with N (a pipelined NCCL broadcast
is bandwidth-bound). Every number the table shows is computed here from the JSON files and ASSUMPTIONS.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "design" / "async.md"
RESULTS = REPO / "bench" / "results"
START, END = "<!-- async-cost-model:start -->", "<!-- async-cost-model:end -->"
GPU_COUNTS = (8, 64, 512)
BASE_GPUS = 8

ASSUMPTIONS = {
    "push_s": (2.2, "weight push of an 8B model over NCCL, verl's published figure (as quoted in issue 43)"),
    "step_s_at_8": (600.0, "an 8B GRPO step of the global batch below on 8 GPUs (assumed: sets only the push's share)"),
    "global_batch": (512 * 16, "sequences per step: 512 prompts x G = 16 (DAPO's batch)"),
    "knee_rows": (256, "decode rows per GPU below which a step costs the same (DESIGN.md: 'a knee in the hundreds')"),
    "published_rollout_share": (0.91, "rollout share of a GRPO step on GPUs, FastGRPO's lower end (91-98%)"),
}


@dataclass(frozen=True)
class Shape:
    """One workload: its rollout share r of an on-policy step and its rollout occupancy u, and where they came from."""

    name: str
    rollout_share: float
    occupancy: float
    source: str


def measured_shapes(results: Path = RESULTS) -> list[Shape]:
    """The workloads whose split or occupancy bench/results measured on this CPU."""
    def read(name: str) -> dict:
        return json.loads((results / name).read_text())

    e2e = read("e2e_smollm2-zero-shot.json")["shapes"][0]
    phases = e2e["phases_s"]["turbogrpo"]
    rollout, update = phases["rollout"], phases["update"] + phases["logprobs"]
    gsm8k = Shape("GSM8K zero-shot (SmolLM2 split)", rollout / (rollout + update),
                  e2e["mean_completion_tokens_turbogrpo"] / e2e["max_new_tokens"],
                  "e2e_smollm2-zero-shot: rollout / (rollout + update); mean / max completion tokens")
    multiturn = read("multiturn_smollm2_calculator.json")["step"]
    phases, shape = multiturn["phases_s"]["turbogrpo"], multiturn["shape"]
    rollout, update = phases["rollout"], phases["update"] + phases["logprobs"]
    calculator = Shape("calculator, multi-turn (SmolLM2 split)", rollout / (rollout + update),
                       multiturn["turbogrpo_completion_length"] / shape["max_conversation_tokens"],
                       "multiturn_smollm2_calculator: step phases; mean model tokens / max_conversation_tokens")
    tail = read("rollout.json")["long_tail"]
    long_tail = Shape("long tail (GPU split)", ASSUMPTIONS["published_rollout_share"][0],
                      tail["live_batch_row_steps"] / tail["padded_batch_row_steps"],
                      "rollout.json long_tail: live / padded row-steps; rollout share as published")
    return [gsm8k, calculator, long_tail]


@dataclass(frozen=True)
class Schedule:
    """One asynchronous schedule's step: its seconds, its rollout pool and what bounds it."""

    seconds: float
    rollout_gpus: int
    bound: str


@dataclass(frozen=True)
class StepCost:
    """Seconds of one step at ``num_gpus``: on-policy, k = 1, and k = 1 with partial rollouts."""

    num_gpus: int
    on_policy_s: float
    k1: Schedule
    k1_partial: Schedule


def rollout_s(share: float, step_s: float, num_gpus: int, knee_ratio: float) -> float:
    """R(n): the rollout of the global batch on ``num_gpus`` (floored at the decode knee)."""
    return share * step_s * max(BASE_GPUS / num_gpus, 1 / knee_ratio)


def update_s(share: float, step_s: float, num_gpus: int) -> float:
    """U(n): the update of the global batch on ``num_gpus`` (ideal data parallelism)."""
    return (1 - share) * step_s * BASE_GPUS / num_gpus


def overlapped(r: float, step_s: float, num_gpus: int, knee_ratio: float, push_s: float, occupancy: float
               ) -> Schedule:
    """min over whole rollout pools n_R in 1..N-1 of max(u R(n_R), U(N - n_R)) + P, with what bounds it: the
    push (a quarter of the step or more), the longest generation (the rollout at its knee floor), or the
    larger of the two pools (the split is whole GPUs, so they cannot be balanced exactly)."""
    def cost(n: int) -> float:
        return max(occupancy * rollout_s(r, step_s, n, knee_ratio), update_s(r, step_s, num_gpus - n)) + push_s

    n = min(range(1, num_gpus), key=cost)
    seconds, rollout = cost(n), occupancy * rollout_s(r, step_s, n, knee_ratio)
    if push_s >= 0.25 * seconds:
        bound = "weight push"
    elif rollout < update_s(r, step_s, num_gpus - n):
        bound = "update pool"
    elif BASE_GPUS / n <= 1 / knee_ratio:
        bound = "longest generation (knee floor)"
    else:
        bound = "rollout pool"
    return Schedule(seconds, n, bound)


def step_cost(shape: Shape, num_gpus: int, *, step_s: float, push_s: float, knee_ratio: float) -> StepCost:
    """One step of ``shape`` at ``num_gpus`` under the three schedules (see the module docstring)."""
    r = shape.rollout_share
    on_policy = rollout_s(r, step_s, num_gpus, knee_ratio) + update_s(r, step_s, num_gpus)
    return StepCost(num_gpus, on_policy, overlapped(r, step_s, num_gpus, knee_ratio, push_s, 1.0),
                    overlapped(r, step_s, num_gpus, knee_ratio, push_s, shape.occupancy))


def table(shapes: list[Shape] | None = None) -> str:
    """The page's table: one row per (workload, GPU count)."""
    shapes = measured_shapes() if shapes is None else shapes
    step_s, push_s = ASSUMPTIONS["step_s_at_8"][0], ASSUMPTIONS["push_s"][0]
    knee_ratio = ASSUMPTIONS["global_batch"][0] / (BASE_GPUS * ASSUMPTIONS["knee_rows"][0])
    lines = ["| workload shape | r | u | GPUs | on-policy step | k=1 step (rollout GPUs) | k=1 speedup | k=1 bound "
             "| k=1 + partial step (rollout GPUs) | k=1 + partial speedup | k=1 + partial bound | push share |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape in shapes:
        for num_gpus in GPU_COUNTS:
            cost = step_cost(shape, num_gpus, step_s=step_s, push_s=push_s, knee_ratio=knee_ratio)
            k1, partial = cost.k1, cost.k1_partial
            lines.append(f"| {shape.name} | {shape.rollout_share:.2f} | {shape.occupancy:.2f} | {num_gpus} "
                         f"| {cost.on_policy_s:.1f} s | {k1.seconds:.1f} s ({k1.rollout_gpus}) "
                         f"| {cost.on_policy_s / k1.seconds:.2f}x | {k1.bound} "
                         f"| {partial.seconds:.1f} s ({partial.rollout_gpus}) "
                         f"| {cost.on_policy_s / partial.seconds:.2f}x | {partial.bound} "
                         f"| {push_s / partial.seconds:.0%} |")
    ceilings = ", ".join(f"{s.name} {1 / max(s.rollout_share, 1 - s.rollout_share):.2f}x" for s in shapes)
    lines += ["", f"Overlap ceiling 1 / max(r, 1 - r), the most any overlap of rollout and update can buy with no "
                  f"tail reclaimed, even on two machines: {ceilings}."]
    sources = "; ".join(f"{s.name}: {s.source}" for s in shapes)
    assumptions = "; ".join(f"{key} = {value:g} ({why})" for key, (value, why) in ASSUMPTIONS.items())
    return "\n".join([*lines, "", f"Inputs: {sources}.", "", f"Assumptions: {assumptions}."])


def render(page_text: str, shapes: list[Shape] | None = None) -> str:
    """``page_text`` with the generated table between its markers."""
    if START not in page_text or END not in page_text:
        raise ValueError(f"{PAGE.relative_to(REPO)} lacks the markers {START} ... {END}")
    head, rest = page_text.split(START, 1)
    _, tail = rest.split(END, 1)
    note = ("<!-- Generated by scripts/async_cost_model.py from bench/results/*.json and its ASSUMPTIONS; "
            "tests/docs/test_async_cost_model.py keeps it current. -->")
    return f"{head}{START}\n{note}\n\n{table(shapes)}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed page is out of date")
    args = parser.parse_args(argv)
    current = PAGE.read_text(encoding="utf-8")
    wanted = render(current)
    if args.check:
        if current != wanted:
            print(f"{PAGE.relative_to(REPO)} is out of date: run python scripts/async_cost_model.py")
            return 1
        return 0
    PAGE.write_text(wanted, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
