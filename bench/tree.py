"""Tree-shared training forward on a synthetic deep trie vs. one row per sequence vs. prompt-only sharing.

Forward + backward of the mean log-prob of every token after the prompt, on the bench model of
bench/prefix.py (Qwen2-style, hidden 512, 8 layers, vocab 16384, float32). A shape ``P/b1xb2x.../T``
is one prompt of P tokens, branching b1 ways into turns of T tokens, each of those b2 ways, and so
on: ``prod(b)`` sequences of ``P + len(b) * T`` tokens, all of them leaves. This is part (c) of
issue 34's benchmark; parts (a) real SmolLM2 conversations and (b) branching rollouts are
``bench/tree_real.py``; both take ``Case`` and the contenders from ``bench/tree_cases.py``.

Contenders, alternated run by run in one process:
* ``rows``: one row per sequence (the model's own forward of each sequence, LM head on loss tokens);
* ``prefix_grouper``: prefix_grouper 0.0.1.post1, sharing the prompt only (as bench/prefix.py runs it);
* ``one_level``: turbogrpo's own shared-prefix forward (prompt once, ``backend="cascade"``);
* ``tree``: the trie forward (``turbogrpo.tree.tree_logprobs``, ``backend="cascade"``).

Each shape reports the token-FLOP ratio of the rows and the prompt-only layouts against the tree
(``turbogrpo.tree.cost``) and, without ``--quick``, each contender's peak memory (a fresh process
each, RSS growth over the set-up state).

    python bench/tree.py              # all shapes, 3 interleaved repeats, memory probes (results/tree.json)
    python bench/tree.py --quick      # a tiny shape, 1 repeat, no memory probes (results/tree_quick.json)
    python bench/tree.py --shapes 512/4x2x2/64
    python bench/tree.py --model smollm2   # SmolLM2-135M's weights, the deepest trie (results/tree_smollm2.json)
    python bench/tree.py --kernels    # the tree attention backends against each other (results/tree_kernels.json)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (interleaved_medians, peak_rss_delta_mb, peak_rss_mb, print_table, reset_peak_rss,  # noqa: E402
                     write_results)
from prefix import BENCH_MODEL, bench_model  # noqa: E402
from tree_cases import CONTENDERS, REAL_CONTENDERS, Case, real_model, run_tree  # noqa: E402

from turbogrpo.prefix.cost import ModelDims  # noqa: E402
from turbogrpo.tree import per_sequence_logprobs, tree_logprobs  # noqa: E402
from turbogrpo.tree.cost import tree_flops  # noqa: E402

SHAPES = ["512/4x2x2/64", "256/2x2x2x2/32", "1024/8x2/128", "128/4x4/256"]
SMOLLM2_SHAPES = ["256/2x2x2x2/32"]  # SmolLM2: 30 layers; 512/4x2x2/64 as rows (11k tokens) passed 20 GB
QUICK_SHAPES = ["32/2x2/8"]
KERNEL_SHAPE = "256/4x2x2/32"   # small: the dense reference's [N, N] mask must fit
ATTENTION_SHAPES = [KERNEL_SHAPE, "512/4x4x2/64"]   # attention alone: 1152 and 3840 trie tokens


def smollm2_model():
    return real_model()[0]


MODELS = {"bench": bench_model, "smollm2": smollm2_model}
"""--model: the random-init bench model of bench/prefix.py, or SmolLM2-135M-Instruct's weights (float32)."""


def memory_probe(name: str, shape: str, model_name: str) -> None:
    """Child process entry: one forward+backward, print peak RSS growth over the set-up state."""
    if shape.endswith(".pt"):  # a saved case of real conversations (bench/tree_real.py)
        model, case, contenders = real_model()[0], Case.load(Path(shape)), REAL_CONTENDERS
    else:
        model = MODELS[model_name]()
        case, contenders = Case.synthetic(shape, vocab=model.config.vocab_size), CONTENDERS
    before = reset_peak_rss()
    contenders[name](model, case)
    print(f"PEAK_MB {peak_rss_mb() - before:.1f}")


def max_logprob_gap(model, case: Case) -> float:
    with torch.no_grad():
        tree, rows = tree_logprobs(model, case.trie).logps, per_sequence_logprobs(model, case.trie).logps
        return (tree - rows).abs().max().item()


def kernels_main(repeats: int, warmup: int) -> None:
    """The tree attention backends against each other on one small trie: forward + backward (cascade,
    reference) and forward only (those plus flex, which has no CPU backward), alternated."""
    model, case = bench_model(), Case.synthetic(KERNEL_SHAPE)

    def forward_only(backend):
        def run():
            with torch.no_grad():
                tree_logprobs(model, case.trie, backend=backend)
        return run

    def step(backend):
        return lambda: (model.zero_grad(set_to_none=True), run_tree(model, case, backend))
    times = interleaved_medians({"cascade fwd+bwd": step("cascade"), "reference fwd+bwd": step("reference"),
                                 "cascade fwd": forward_only("cascade"), "reference fwd": forward_only("reference"),
                                 "flex fwd": forward_only("flex")}, repeats=repeats, warmup=warmup)
    attention_times = {shape: attention_only_times(shape, repeats, warmup) for shape in ATTENTION_SHAPES}
    write_results("tree_kernels_quick" if repeats == 1 else "tree_kernels", {
        "load_average": os.getloadavg(), "model": BENCH_MODEL, "shape": KERNEL_SHAPE,
        "trie_tokens": case.trie.num_tokens, "repeats": repeats, "warmup": warmup, "times": times,
        "attention_only": attention_times})
    print_table(f"tree attention backends in the bench model, {KERNEL_SHAPE} ({case.trie.num_tokens} trie tokens), "
                f"seconds (median of {repeats})", ["backend", "median", "min"],
                [[name, t["median_s"], t["min_s"]] for name, t in times.items()])
    print_table("one attention layer alone (8 heads / 2 KV heads, head dim 64), fwd+bwd seconds",
                ["shape", "backend", "median", "min"],
                [[shape, name, t["median_s"], t["min_s"]] for shape, ts in attention_times.items()
                 for name, t in ts.items()])
    print(f"load average {os.getloadavg()}")


def attention_only_times(shape: str, repeats: int, warmup: int) -> dict:
    """One attention layer's plan, forward + backward, per backend (the plan built once, as for a trie)."""
    from turbogrpo.tree import TREE_BACKENDS
    trie = Case.synthetic(shape).trie
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, trie.num_tokens, 64, generator=g)
    k, v = (torch.randn(1, 2, trie.num_tokens, 64, generator=g) for _ in range(2))

    def step(backend):
        plan = TREE_BACKENDS[backend].plan(trie, torch.device("cpu"))

        def run():
            inputs = [x.clone().requires_grad_() for x in (q, k, v)]
            plan(None, *inputs, scaling=0.125, sliding_window=None).sum().backward()
        return run
    return interleaved_medians({name: step(name) for name in ("cascade", "reference")}, repeats=repeats,
                               warmup=warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny shape, 1 repeat, no warm-up, no memory probes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", default=None, help="comma-separated P/b1xb2/T, e.g. 512/4x2x2/64")
    parser.add_argument("--kernels", action="store_true", help="time the tree attention backends instead")
    parser.add_argument("--model", choices=sorted(MODELS), default="bench",
                        help="bench: random-init Qwen2-style bench model; smollm2: SmolLM2-135M-Instruct's weights")
    parser.add_argument("--memory-probe", nargs=2, metavar=("NAME", "SHAPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_probe:
        return memory_probe(*args.memory_probe, args.model)
    repeats, warmup = (1, 0) if args.quick else (args.repeats, 1)
    if args.kernels:
        return kernels_main(repeats, warmup)
    full = SHAPES if args.model == "bench" else SMOLLM2_SHAPES
    shapes = args.shapes.split(",") if args.shapes else QUICK_SHAPES if args.quick else full
    # Only a full run replaces the committed results; a partial one is written beside them.
    suffix = "" if args.model == "bench" else f"_{args.model}"
    results_name = f"tree{suffix}_quick" if args.quick else f"tree{suffix}" if shapes == full else f"tree{suffix}_partial"
    model = MODELS[args.model]()
    dims = ModelDims.of(model.config)
    rows, records = [], []
    for shape in shapes:
        case = Case.synthetic(shape, vocab=model.config.vocab_size)
        gap = max_logprob_gap(model, case)
        times = interleaved_medians({name: (lambda fn=fn: (model.zero_grad(set_to_none=True), fn(model, case)))
                                     for name, fn in CONTENDERS.items()}, repeats=repeats, warmup=warmup)
        flops = tree_flops(dims, case.trie)
        memory = {} if args.quick else {name: peak_rss_delta_mb([__file__, "--memory-probe", name, shape,
                                                                 "--model", args.model])
                                         for name in CONTENDERS}
        median = {name: t["median_s"] for name, t in times.items()}
        record = {"shape": shape, "sequences": case.trie.num_sequences, "trie_tokens": case.trie.num_tokens,
                  "row_tokens": case.trie.num_row_tokens, "times": times,
                  "speedup_vs_rows": median["rows"] / median["tree"],
                  "speedup_vs_prefix_grouper": median["prefix_grouper"] / median["tree"],
                  "speedup_vs_one_level": median["one_level"] / median["tree"],
                  "flop_ratio_vs_rows": flops.ratio_vs_rows,
                  "flop_ratio_vs_shared_prompt": flops.ratio_vs_shared_prompt,
                  "speedup_over_flop_ratio_vs_rows": median["rows"] / median["tree"] / flops.ratio_vs_rows,
                  "peak_memory_mb": memory, "max_abs_logprob_gap": gap}
        records.append(record)
        rows.append([shape, case.trie.num_row_tokens, case.trie.num_tokens, median["rows"], median["prefix_grouper"],
                     median["one_level"], median["tree"], record["speedup_vs_rows"], flops.ratio_vs_rows,
                     record["speedup_vs_prefix_grouper"], record["speedup_vs_one_level"],
                     flops.ratio_vs_shared_prompt,
                     "/".join(f"{memory[n]:.0f}" for n in CONTENDERS) if memory else "-", f"{gap:.1e}"])
        print(f"done {shape}", flush=True)
        # Written after every shape, so an interrupted run keeps what it measured. Load averages: a shared
        # machine slows every contender, so compare ratios.
        write_results(results_name, {"load_average": os.getloadavg(),
                                     "model": BENCH_MODEL if args.model == "bench" else args.model, "dtype": "float32",
                                     "repeats": repeats, "warmup": warmup, "shapes": records})
    print_table(f"fwd+bwd seconds (median of {repeats}), {args.model} model float32, synthetic deep tries P/branching/T",
                ["shape", "row tok", "tree tok", "rows", "prefix_grouper", "one_level", "tree", "x rows",
                 "FLOP x rows", "x pg", "x one_level", "FLOP x prompt", "peak MB rows/pg/1lvl/tree", "max |dlogp|"],
                rows)
    print(f"load average {os.getloadavg()}")
    assert all(math.isfinite(r["max_abs_logprob_gap"]) for r in records)


if __name__ == "__main__":
    main()
