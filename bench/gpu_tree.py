"""GPU part "tree" of bench/gpu.py: the tree-shared training forward (issue 34) on a GPU.

    python bench/gpu.py --only tree
    python bench/gpu_tree.py --cpu-smoke     # the same code path on a tiny CPU model (no flex: no CPU backward)

On a Qwen2-0.5B-shaped model (random init, bfloat16, built on the GPU) and bench/tree.py's synthetic
deep tries ``P/b1xb2.../T``, forward + backward of the mean log-prob of every token after the prompt,
median of 3 runs after 2 warm-ups, peak GPU memory of the first call, for:

* ``rows``: one row per sequence;
* ``prefix_grouper``: prefix_grouper sharing the prompt only (skipped when it is not installed);
* ``one_level``: turbogrpo's shared-prefix forward (prompt once, ``backend="auto"``);
* ``tree_flex`` / ``tree_cascade`` / ``tree_auto``: the trie forward under each tree backend
  (flex: FlexAttention with the ancestor rule as a ``mask_mod``, no dense N x N mask).

Each row carries the token-FLOP ratios (``turbogrpo.tree.cost``) to hold the speedups against.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_prefix import MODELS, _PrefixGrouperFlashAttention, measure  # noqa: E402
from harness import print_table  # noqa: E402
from prefix import run_prefix_grouper  # noqa: E402
from tree import Case, run_rows, run_tree  # noqa: E402

import turbogrpo  # noqa: E402
from turbogrpo.prefix.cost import ModelDims  # noqa: E402
from turbogrpo.tree.attention import TREE_BACKENDS as REGISTERED_TREE_BACKENDS  # noqa: E402
from turbogrpo.tree.cost import tree_flops  # noqa: E402

MODEL = "0.5B"
# Priority order: issue 34's synthetic shapes at GPU lengths, the deepest first.
SHAPES = ["1024/4x2x2/256", "512/2x2x2x2/128", "2048/8x2/512", "512/4x4/1024"]
TREE_BACKENDS = ("flex", "cascade", "auto")


def contenders(case: Case, device: torch.device) -> dict:
    """name -> fn(model, prompts, completions) (the signature of gpu_prefix.measure); the trie stays on the
    host, as the trainer builds it, and the tree forward uploads it itself."""
    prompts = [p.to(device) for p in case.prompts]
    completions = [[c.to(device) for c in group] for group in case.completions]

    def one_level(model, *_):
        per_group = turbogrpo.completion_logprobs(model, prompts, completions)
        torch.cat([t for group in per_group for t in group]).float().mean().backward()

    table = {"rows": lambda model, *_: run_rows(model, case)}
    try:
        import prefix_grouper  # noqa: F401
        table["prefix_grouper"] = lambda model, *_: run_prefix_grouper(model, prompts, completions,
                                                                       _PrefixGrouperFlashAttention)
    except ImportError:
        print("[gpu tree] prefix_grouper is not installed: its column is skipped", flush=True)
    table["one_level"] = one_level
    for backend in TREE_BACKENDS:
        if backend != "auto" and not REGISTERED_TREE_BACKENDS[backend].available(device, True):
            print(f"[gpu tree] tree backend {backend!r} cannot train on {device.type}: skipped", flush=True)
            continue
        table[f"tree_{backend}"] = lambda model, *_, backend=backend: run_tree(model, case, backend)
    return table


def build_model(config: dict, device: str, dtype: torch.dtype) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2ForCausalLM._from_config(Qwen2Config(**config, max_position_embeddings=32768), dtype=dtype)


def measure_shapes(model, shapes: list[str], deadline: float, results: dict) -> list[list]:
    device = model.get_input_embeddings().weight.device
    dims, printed = ModelDims.of(model), []
    for shape in shapes:
        if time.perf_counter() > deadline:
            results.setdefault("skipped_shapes", []).append(f"{shape}: out of budget")
            continue
        case = Case.synthetic(shape)
        flops = tree_flops(dims, case.trie)
        row = {"shape": shape, "sequences": case.trie.num_sequences, "trie_tokens": case.trie.num_tokens,
               "row_tokens": case.trie.num_row_tokens, "flop_ratio_vs_rows": flops.ratio_vs_rows,
               "flop_ratio_vs_shared_prompt": flops.ratio_vs_shared_prompt, "times": {}, "errors": {}}
        table = contenders(case, device)
        for name, fn in table.items():
            if time.perf_counter() > deadline:
                row["errors"][name] = "out of budget"
                continue
            try:
                row["times"][name] = measure(fn, model, None, None)
            except Exception as error:  # one contender's failure (OOM, a kernel) must not lose the row
                row["errors"][name] = f"{type(error).__name__}: {str(error)[:200]}"
                model.zero_grad(set_to_none=True)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        medians = {name: t["median_s"] for name, t in row["times"].items()}
        best_tree = min((medians[n] for n in medians if n.startswith("tree_")), default=None)
        for baseline in ("rows", "prefix_grouper", "one_level"):
            if best_tree and baseline in medians:
                row[f"best_tree_speedup_vs_{baseline}"] = medians[baseline] / best_tree
        results["rows"].append(row)
        printed.append([shape, row["row_tokens"], row["trie_tokens"],
                        *(f"{medians[n]:.3f}" if n in medians else "-" for n in table),
                        f"{flops.ratio_vs_rows:.2f}",
                        *(f"{row[k]:.2f}" if k in row else "-" for k in ("best_tree_speedup_vs_rows",
                                                                          "best_tree_speedup_vs_prefix_grouper"))])
        print(f"[gpu tree] done {shape}", flush=True)
    print_table("fwd+bwd seconds, median of 3 after 2 warm-ups", ["shape", "row tok", "trie tok", *table,
                                                                  "FLOP x rows", "tree x rows", "tree x pg"], printed)
    return printed


def run(results: dict, budget_s: float) -> None:
    if not torch.cuda.is_available():
        print("[gpu tree] no CUDA device: skipped", flush=True)
        results.update(status="skipped", reason="no CUDA device")
        return
    deadline = time.perf_counter() + budget_s
    results.update(model=MODEL, model_config=MODELS[MODEL], dtype="bfloat16", rows=[],
                   device=torch.cuda.get_device_name())
    measure_shapes(build_model(MODELS[MODEL], "cuda", torch.bfloat16), SHAPES, deadline, results)
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="run every contender once on a tiny CPU model")
    args = parser.parse_args()
    if not args.cpu_smoke:
        parser.error("run it through bench/gpu.py --only tree, or with --cpu-smoke")
    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=16384)
    results = {"rows": []}
    measure_shapes(build_model(tiny, "cpu", torch.float32), ["16/2x2/4"], time.perf_counter() + 300, results)
    errors = {name: e for row in results["rows"] for name, e in row["errors"].items()}
    if errors:
        sys.exit(f"gpu_tree smoke: {errors}")


if __name__ == "__main__":
    main()
