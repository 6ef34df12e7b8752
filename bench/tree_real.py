"""Parts (a) and (b) of issue 34's tree benchmark: real multi-turn conversations of SmolLM2-135M-Instruct.

(a) ``conversations``: K prompts x G unbranched conversations on a built-in task (``TASKS``), sampled by the
    multi-turn engine; the trie shares the prompt (and whatever first tokens happen to agree).
(b) ``branching``: the same task rolled out with ``rollout.branching`` (default [4, 2] over 3 turns): the
    G = 8 conversations of a prompt share their first turn 2 by 2, so the trie holds it once per pair.

For each part, forward + backward of the mean log-prob of the conversations' model tokens (the training
loss's shape), alternated run by run in one process, float32 on the CPU:

* ``rows``: one row per conversation; ``per_turn``: one row per model turn, its whole history as the prompt
  (AReaL's "individual" / SkyRL's step-wise samples), scoring that turn's tokens only;
* ``prefix_grouper``: prefix_grouper 0.0.1.post1 sharing the prompt only (it scores every completion token);
* ``one_level``: turbogrpo's shared-prompt forward (``backend="cascade"``, every completion token scored);
* ``tree``: the trie forward (``turbogrpo.tree.tree_logprobs``, cascade).

Reported per part: medians, the token-FLOP ratio of each layout against the tree (``turbogrpo.tree.cost``;
the LM head counted on the model tokens in every layout), and without ``--quick`` each contender's peak
memory: peak RSS growth (``/proc`` VmHWM after clear_refs) of one forward + backward in a fresh process that
loads the model and the saved conversations. Part (b) also times the branching rollout against a rollout of
as many unbranched conversations (same prompts, same limits), median over seeds: wall time, model tokens
sampled, environment tokens prefilled, forwards.

    python bench/tree_real.py                    # both parts (results/tree_real.json)
    python bench/tree_real.py --quick            # 1 prompt, short turns, 1 repeat, no memory (results/tree_real_quick.json)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved_medians, peak_rss_delta_mb, print_table, write_results  # noqa: E402
from tree_cases import REAL_CONTENDERS, REAL_MODEL, Case, real_model  # noqa: E402

from turbogrpo.env import TurnLimits, run_episodes  # noqa: E402
from turbogrpo.env.tasks import GuessNumber  # noqa: E402
from turbogrpo.prefix.cost import ModelDims  # noqa: E402
from turbogrpo.rollout import SamplingConfig  # noqa: E402
from turbogrpo.tree import per_sequence_logprobs, tree_logprobs  # noqa: E402
from turbogrpo.tree.cost import tree_flops  # noqa: E402

END_OF_TURN = "<|im_end|>"


def guess_number_rows(num_prompts: int) -> tuple[list[dict], list[list[dict]]]:
    """GuessNumber's rows (a secret per prompt) and the user message that opens each game."""
    rows = [{"secret": 1 + (5 * k + 6) % 16} for k in range(num_prompts)]
    text = ("Let's play a game. I am thinking of a whole number from 1 to 16. Guess it: reply with just the "
            "number, like: 8. I will tell you whether mine is higher or lower.")
    return rows, [[{"role": "user", "content": text}] for _ in rows]


TASKS = {"guess_number": (GuessNumber, guess_number_rows)}
"""Built-in tasks by name: (environment factory, ``rows(num_prompts) -> (rows, prompt messages)``)."""


def sample_conversations(task: str, num_prompts: int, num_samples: int, branching: list[int], max_turns: int,
                         turn_tokens: int, seed: int):
    """One rollout (``turbogrpo.env.run_episodes``) of ``task`` on SmolLM2; returns its ``EnvRollout``."""
    model, tokenizer = real_model()
    factory, make_rows = TASKS[task]
    rows, messages = make_rows(num_prompts)
    return run_episodes(model, tokenizer, rows, messages, factory, num_samples=num_samples,
                        sampling=SamplingConfig(max_new_tokens=turn_tokens), max_turns=max_turns,
                        limits=TurnLimits(turn_tokens, max_turns * (turn_tokens + 24)), end_of_turn=END_OF_TURN,
                        seed=seed, reply_timing="next_step", branching=branching)


def case_of(rollout) -> Case:
    """The rollout's conversations as a ``Case`` scored on their model tokens."""
    groups = rollout.rollout.groups
    sizes, start = list(groups.sizes), 0
    completions, masks = [], []
    for size in sizes:
        completions.append([c.cpu() for c in groups.completions[start:start + size]])
        masks.append([m.cpu() for m in groups.model_mask[start:start + size]])
        start += size
    return Case([p.cpu() for p in groups.prompts], completions, masks)




def measure_layouts(name: str, case: Case, repeats: int, warmup: int, memory: bool) -> dict:
    """Times, FLOP ratios and (``memory``) peak RSS of every contender on ``case``."""
    model, _ = real_model()
    dims = ModelDims.of(model.config)
    with torch.no_grad():
        gap = (tree_logprobs(model, case.trie).logps - per_sequence_logprobs(model, case.trie).logps).abs().max()
    times = interleaved_medians({n: (lambda fn=fn: (model.zero_grad(set_to_none=True), fn(model, case)))
                                 for n, fn in REAL_CONTENDERS.items()}, repeats=repeats, warmup=warmup)
    flops, per_turn = tree_flops(dims, case.trie), tree_flops(dims, case.per_turn)
    peak = {}
    if memory:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / f"{name}.pt"
            case.save(path)
            tree_script = str(Path(__file__).resolve().parent / "tree.py")
            peak = {n: peak_rss_delta_mb([tree_script, "--memory-probe", n, str(path)]) for n in REAL_CONTENDERS}
    median = {n: t["median_s"] for n, t in times.items()}
    return {"part": name, "sequences": case.trie.num_sequences, "trie_tokens": case.trie.num_tokens,
            "row_tokens": case.trie.num_row_tokens, "per_turn_samples": case.per_turn.num_sequences,
            "per_turn_tokens": case.per_turn.num_row_tokens, "model_tokens": int(sum(case.trie.num_loss_tokens)),
            "times": times, "speedup": {n: median[n] / median["tree"] for n in median},
            "flop_ratio": {"rows": flops.ratio_vs_rows, "prefix_grouper": flops.ratio_vs_shared_prompt,
                           "one_level": flops.ratio_vs_shared_prompt, "per_turn": per_turn.rows / flops.tree},
            "tree_share_of_flop_ratio_vs_rows": median["rows"] / median["tree"] / flops.ratio_vs_rows,
            "peak_memory_mb": peak, "peak_memory_method": "peak RSS growth in a fresh process (VmHWM)",
            "max_abs_logprob_gap_tree_vs_rows": float(gap)}


def compare_rollouts(task: str, num_prompts: int, branching: list[int], max_turns: int, turn_tokens: int,
                     seeds: list[int]) -> dict:
    """The branching rollout against as many unbranched conversations, medians over ``seeds`` (alternated)."""
    num_samples = math.prod(branching)
    runs = {"branching": [], "unbranched": []}
    for seed in seeds:
        for name, factors in (("branching", branching), ("unbranched", [])):
            stats = sample_conversations(task, num_prompts, num_samples, factors, max_turns, turn_tokens,
                                         seed).rollout.stats
            runs[name].append({"wall_s": stats.wall_time_s, "model_tokens": stats.num_generated_tokens,
                               "model_tokens_per_s": stats.num_generated_tokens / stats.wall_time_s,
                               "env_tokens": stats.num_env_tokens, "forwards": stats.num_forwards,
                               "turns": stats.num_turns})
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    return {"runs": runs, "median": medians,
            "speedup": medians["unbranched"]["wall_s"] / medians["branching"]["wall_s"],
            "model_token_ratio": medians["unbranched"]["model_tokens"] / max(medians["branching"]["model_tokens"], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 prompt, 16-token turns, 1 repeat, no memory probes")
    parser.add_argument("--task", default="guess_number", choices=sorted(TASKS))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--branching", default="4x2", help="fork factors of part (b), e.g. 4x2")
    parser.add_argument("--turns", type=int, default=3, help="most model turns per conversation")
    parser.add_argument("--turn-tokens", type=int, default=48, help="most model tokens per turn")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    branching = [int(b) for b in args.branching.split("x")]
    num_prompts, turn_tokens, repeats, warmup = args.prompts, args.turn_tokens, args.repeats, 1
    if args.quick:
        num_prompts, turn_tokens, repeats, warmup = 1, 16, 1, 0
    num_samples = math.prod(branching)
    settings = {"model": REAL_MODEL, "dtype": "float32", "task": args.task, "prompts": num_prompts, "G": num_samples,
                "branching": branching, "max_turns": args.turns, "turn_tokens": turn_tokens, "repeats": repeats,
                "warmup": warmup}
    records = []
    for part, factors in (("a_conversations", []), ("b_branching", branching)):
        rollout = sample_conversations(args.task, num_prompts, num_samples, factors, args.turns, turn_tokens, seed=0)
        records.append(measure_layouts(part, case_of(rollout), repeats, warmup, memory=not args.quick))
        records[-1]["env_turns_per_conversation"] = rollout.metrics["env/turns"]
        print(f"done part {part}", flush=True)
    rollouts = compare_rollouts(args.task, num_prompts, branching, args.turns, turn_tokens, list(range(repeats)))
    write_results("tree_real_quick" if args.quick else "tree_real",
                  {"load_average": os.getloadavg(), "settings": settings, "parts": records, "rollouts": rollouts})
    names = list(REAL_CONTENDERS)
    print_table(f"fwd+bwd seconds (median of {repeats}), {REAL_MODEL} float32, {args.task}, {num_prompts} prompts x G="
                f"{num_samples}; x = contender time / tree time; FLOP x = contender FLOPs / tree FLOPs",
                ["part", "row tok", "tree tok", *names, *(f"x {n}" for n in names if n != "tree"),
                 "FLOP x rows", "FLOP x pg", "FLOP x per_turn", "peak MB " + "/".join(names)],
                [[r["part"], r["row_tokens"], r["trie_tokens"], *(r["times"][n]["median_s"] for n in names),
                  *(r["speedup"][n] for n in names if n != "tree"), r["flop_ratio"]["rows"],
                  r["flop_ratio"]["prefix_grouper"], r["flop_ratio"]["per_turn"],
                  "/".join(f"{r['peak_memory_mb'][n]:.0f}" for n in names) if r["peak_memory_mb"] else "-"]
                 for r in records])
    print_table(f"rollout, branching {branching} vs {num_samples} unbranched conversations per prompt (median of "
                f"{repeats} seeds)", ["rollout", "wall s", "model tokens", "tokens/s", "env tokens", "forwards", "turns"],
                [[n, m["wall_s"], m["model_tokens"], m["model_tokens_per_s"], m["env_tokens"], m["forwards"],
                  m["turns"]]
                 for n, m in rollouts["median"].items()])
    print(f"load average {os.getloadavg()}")
    assert all(r["max_abs_logprob_gap_tree_vs_rows"] < 1e-3 for r in records)


if __name__ == "__main__":
    main()
