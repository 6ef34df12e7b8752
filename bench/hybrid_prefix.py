"""Issue 53 part 6 (a) and (b): the shared-prefix and trie training forwards on a Qwen3.5-shaped hybrid.

The model is Qwen3.5's text decoder (model type qwen3_5_text: gated DeltaNet in three layers of four, gated full
attention in every fourth) at SmolLM2-135M's size (``HYBRID_MODEL``: hidden 576, 30 layers, MLP 1536, 9 / 3
attention heads of 64, vocabulary 49152, tied embeddings), with RANDOM weights: speed does not depend on them.
The DeltaNet layers run transformers' PyTorch kernels (flash-linear-attention is a GPU kernel; bench/gpu_hybrid.py
measures it there).

(a) ``prefix``: forward + backward of the mean completion log-prob of one GSM8K prompt under SmolLM2's chat
    template, few-shot (4 worked solutions in the system prompt) and zero-shot, with G completions of S random
    ids, in float32 and bfloat16 (CPU autocast over float32 weights, as model.dtype = "bfloat16" trains).
    Contenders, alternated run by run in one process:
    * ``standard``: G rows ``[prompt, completion]`` through the model's own forward (transformers' layers, no
      turbogrpo plan), the LM head on the completion positions;
    * ``shared``: turbogrpo's shared-prefix forward (``completion_logprobs``, backend "cascade"): the prompt once,
      each DeltaNet layer's state after it handed to every completion.
(b) ``tree``: forward + backward of the mean log-prob of the model tokens of calculator conversations
    (configs/smollm2_calculator.toml's task and prompts, K prompts x G conversations with rollout.branching
    [4, 2], sampled by SmolLM2-135M-Instruct with the native engine: a random-weight hybrid would not hold a real
    conversation), scored on the hybrid:
    * ``rows``: one row per conversation through the model's own forward;
    * ``tree``: turbogrpo's trie forward (``tree_logprobs``, cascade).
    Both run in micro-batches of at most ``--micro-batch-tokens`` tokens (padded rows; trie tokens, cut between
    whole conversations as ``turbogrpo.tree.micro_batches`` cuts them, so a prompt shared across micro-batches runs
    once in each, as the trainer's ``train.micro_batch_tokens`` does), each backward the micro-batch's share of the
    mean, so the gradients are those of one pass over all. Every contender's peak resident memory over one
    forward + backward is reported (VmHWM after clear_refs, in this process): 64 rows at once took over 24 GiB.

Each row reports the forward FLOP ratio of the two layouts beside the measured speedup (``HybridFlops``: the
linear layers per token, the gated delta rule per token, attention per visible query-key pair in the full
attention layers, the LM head per scored token) and the largest log-prob gap between them.

    python bench/hybrid_prefix.py                 # (a) and (b) (results/hybrid_prefix.json), ~25 min on 2 cores
    python bench/hybrid_prefix.py --parts tree --out hybrid_prefix_tree   # (b) only, 1536-token micro-batches
    python bench/hybrid_prefix.py --parts prefix  # (a) only
    python bench/hybrid_prefix.py --quick         # a tiny hybrid, tiny shapes, 1 repeat (..._quick.json)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved_medians, peak_rss_mb, print_table, reset_peak_rss, write_results  # noqa: E402
from tree_cases import Case  # noqa: E402

import turbogrpo  # noqa: E402
from turbogrpo.hook import decoder_of  # noqa: E402
from turbogrpo.output_head import logits_head  # noqa: E402
from turbogrpo.prefix import lm_head_logprobs  # noqa: E402
from turbogrpo.tree import TokenTrie, build_trie, micro_batches, tree_logprobs  # noqa: E402

FULL_ATTENTION_EVERY = 4   # Qwen3.5: three gated DeltaNet layers, then one full attention layer
HYBRID_MODEL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, linear_num_key_heads=3,
                    linear_num_value_heads=6, linear_key_head_dim=64, linear_value_head_dim=64,
                    linear_conv_kernel_dim=4, max_position_embeddings=8192, tie_word_embeddings=True)
"""Qwen3.5's text decoder at SmolLM2-135M's size (SmolLM2's hidden, depth, MLP, heads and vocabulary; DeltaNet with
twice as many value heads as key heads, as Qwen3.5)."""
QUICK_MODEL = HYBRID_MODEL | dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                                  linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
GROUP, COMPLETION_LEN = 8, 128          # (a): G completions of S ids, as bench/prefix.py's real-model rows
QUICK_PREFIX_SHAPES = {"few-shot": (96, 16, 4), "zero-shot": (24, 16, 4)}   # P, S, G of random ids
TREE_PROMPTS, TREE_GENERATIONS, TREE_BRANCHING = 8, 8, [4, 2]
QUICK_TREE_SHAPE = "32/2x2/8"           # bench/tree.py's synthetic trie (--quick: no conversations sampled)
# (b)'s micro-batch budget: at SmolLM2 size a token's float32 activations take ~3 MB (transformers' chunked gated
# delta rule keeps much per chunk; 1920 padded row tokens rose 5.8 GB, a 1024-token trie 3.1 GB), so 1536 tokens
# keep the process near 6 GB with the weights and gradients.
TREE_MICRO_BATCH_TOKENS = 1536
QUICK_MICRO_BATCH_TOKENS = 64           # (--quick: two or more micro-batches per contender)


def hybrid_model(settings: dict, seed: int = 0) -> Qwen3_5ForCausalLM:
    """A random-init Qwen3.5-shaped decoder (``settings``), float32, in train mode."""
    types = ["full_attention" if (i + 1) % FULL_ATTENTION_EVERY == 0 else "linear_attention"
             for i in range(settings["num_hidden_layers"])]
    torch.manual_seed(seed)
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**settings, layer_types=types)).float().train()


# ---------------------------------------------------------------- FLOPs


@dataclass(frozen=True)
class HybridFlops:
    """Forward FLOPs of a hybrid's layouts, counted as ``turbogrpo.prefix.cost`` counts an attention model's (norms,
    rotary embeddings and activations left out): ``per_token`` (every layer's weights, the DeltaNet convolution and
    its gated delta rule), ``per_pair`` (a visible query-key pair, over the full-attention layers) and
    ``per_scored_token`` (the LM head)."""

    per_token: float
    per_pair: float
    per_scored_token: float

    @staticmethod
    def of(model: nn.Module, chunk: int = 64) -> HybridFlops:
        """The counts of ``model``. The chunked gated delta rule (chunks of ``chunk`` tokens) costs per token and
        value head about 2C·d_k (the chunk's q·k and k·k scores, causal halves), C·d_v (scores times values) and
        6·d_k·d_v (reading, correcting and updating the d_k x d_v state); the per-chunk triangular solve is left
        out (C² per chunk, under 1/d_k of the rest)."""
        config, decoder = model.config, decoder_of(model)
        weights = sum(m.weight.numel() for m in decoder.layers.modules() if isinstance(m, (nn.Linear, nn.Conv1d)))
        types = config.layer_types
        num_linear, num_full = types.count("linear_attention"), types.count("full_attention")
        d_k, d_v = config.linear_key_head_dim, config.linear_value_head_dim
        delta_rule = config.linear_num_value_heads * (2 * chunk * d_k + chunk * d_v + 6 * d_k * d_v)
        return HybridFlops(per_token=2 * weights + num_linear * delta_rule,
                           per_pair=num_full * 4 * config.num_attention_heads * config.head_dim,
                           per_scored_token=2 * config.hidden_size * config.vocab_size)

    def total(self, tokens: int, pairs: int, scored: int) -> float:
        return tokens * self.per_token + pairs * self.per_pair + scored * self.per_scored_token

    def prefix_ratio(self, prompt_len: int, completion_len: int, group: int) -> float:
        """standard / shared forward FLOPs of one group (G copies of the prompt against one)."""
        row = prompt_len + completion_len
        scored = group * completion_len
        standard = self.total(group * row, group * row * (row + 1) // 2, scored)
        shared = self.total(prompt_len + scored, prompt_len * (prompt_len + 1) // 2
                            + group * (completion_len * prompt_len + completion_len * (completion_len + 1) // 2),
                            scored)
        return standard / shared

    def tree_ratio(self, trie: TokenTrie, parts: list[TokenTrie] | None = None) -> float:
        """rows / tree forward FLOPs of ``trie`` (a tree token sees its depth + 1 ancestors), the tree run as the
        tries ``parts`` (its micro-batches, a shared prompt in each) or whole (None); rows without their padding."""
        scored = sum(trie.num_loss_tokens)
        lengths = trie.sequence_lengths
        rows = self.total(sum(lengths), sum(n * (n + 1) // 2 for n in lengths), scored)
        tree = sum(self.total(part.num_tokens, int((part.position_ids + 1).sum()), 0) for part in parts or [trie])
        return rows / (tree + scored * self.per_scored_token)


# ---------------------------------------------------------------- the model's own forward (the baselines)


def own_forward_logprobs(model, sequences: list[torch.Tensor], scored: list[torch.Tensor]) -> torch.Tensor:
    """Log-probs ``[N]`` of the scored tokens of ``sequences`` (``scored[i]``: ``[L_i]`` bool, never the first
    token), each sequence a row of one right-padded batch through the model's own forward (padding comes after a
    row's tokens, which causal attention and the DeltaNet recurrence never let them see), on the model's device."""
    device = model.get_input_embeddings().weight.device
    ids = nn.utils.rnn.pad_sequence(sequences, batch_first=True).to(device)
    hidden = decoder_of(model)(input_ids=ids).last_hidden_state
    mask = nn.utils.rnn.pad_sequence(scored, batch_first=True).to(device)
    rows, cols = mask[:, 1:].nonzero(as_tuple=True)   # a scored token at t is predicted from position t - 1
    logps, _ = lm_head_logprobs(hidden[rows, cols], logits_head(model), ids[rows, cols + 1], with_entropy=False)
    return logps


def group_rows(prompts, completions) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each completion after its prompt ``[P + S]``, and which of its tokens are scored (the completion's)."""
    sequences = [torch.cat([p, c]) for p, cs in zip(prompts, completions) for c in cs]
    scored = [torch.arange(len(p) + len(c)) >= len(p) for p, cs in zip(prompts, completions) for c in cs]
    return sequences, scored


def run_standard(model, prompts, completions) -> None:
    own_forward_logprobs(model, *group_rows(prompts, completions)).mean().backward()


def run_shared(model, prompts, completions) -> None:
    per_group = turbogrpo.completion_logprobs(model, prompts, completions, backend="cascade")
    torch.cat([t for group in per_group for t in group]).mean().backward()


@dataclass(frozen=True)
class TreeMicroBatches:
    """A trie's sequences split both ways within a token budget: ``rows`` (sequence indices per micro-batch of
    right-padded rows, at most ``budget`` tokens with the padding) and ``tries`` (sequence indices and their trie per
    micro-batch of ``turbogrpo.tree.micro_batches``' split, at most ``budget`` trie tokens). ``num_scored``: loss
    tokens of all sequences, the mean's denominator in every micro-batch."""

    sequences: list[torch.Tensor]
    loss_masks: list[torch.Tensor]
    rows: list[list[int]]
    tries: list[tuple[list[int], TokenTrie]]
    num_scored: int

    @staticmethod
    def of(trie: TokenTrie, budget: int) -> TreeMicroBatches:
        sequences = [trie.input_ids[t] for t in trie.sequence_tokens]
        masks = list(trie.loss_masks)
        tries = [(batch, build_trie([sequences[i] for i in batch], [masks[i] for i in batch]))
                 for batch in micro_batches(sequences, budget)]
        return TreeMicroBatches(sequences, masks, padded_row_batches([len(s) for s in sequences], budget), tries,
                                sum(trie.num_loss_tokens))

    def row_logprobs(self, model) -> Iterator[tuple[list[int], torch.Tensor]]:
        """Per row micro-batch: its sequence indices and their scored tokens' log-probs ``[N_mb]`` (sequence by
        sequence) from the model's own forward."""
        for rows in self.rows:
            yield rows, own_forward_logprobs(model, [self.sequences[i] for i in rows],
                                             [self.loss_masks[i] for i in rows])

    def tree_logprobs(self, model) -> Iterator[tuple[list[int], torch.Tensor]]:
        """Per trie micro-batch: its sequence indices and their log-probs ``[N_mb]`` from the trie forward."""
        for indices, trie in self.tries:
            yield indices, tree_logprobs(model, trie, backend="cascade").logps


def padded_row_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Sequence indices in micro-batches of right-padded rows, longest first, each holding at most ``budget`` tokens
    with its padding (rows x its longest row); a longer sequence is a micro-batch alone."""
    batches, current = [], []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if current and (len(current) + 1) * lengths[current[0]] > budget:
            batches.append(current)
            current = []
        current.append(index)
    return batches + [current]


def backward_of_mean(parts: Iterator[tuple[list[int], torch.Tensor]], num_scored: int) -> None:
    """The mean log-prob's backward, micro-batch by micro-batch (each its share: the gradients of the whole mean,
    and one micro-batch's activations alive at a time)."""
    for _, logps in parts:
        (logps.sum() / num_scored).backward()


def run_rows(model, batches: TreeMicroBatches) -> None:
    backward_of_mean(batches.row_logprobs(model), batches.num_scored)


def run_tree(model, batches: TreeMicroBatches) -> None:
    backward_of_mean(batches.tree_logprobs(model), batches.num_scored)


def per_sequence(parts: Iterator[tuple[list[int], torch.Tensor]], masks: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Sequence index -> its scored tokens' log-probs, from micro-batches' flat log-probs."""
    by_sequence = {}
    for indices, logps in parts:
        by_sequence.update(zip(indices, logps.split([int(masks[i].sum()) for i in indices])))
    return by_sequence


def peak_memory_mb(call) -> dict[str, float]:
    """One ``call`` of this process: its peak resident set (VmHWM after clear_refs; weights and gradients
    included) and how far it rose above the resident set before it (the call's own activations)."""
    before = reset_peak_rss()
    call()
    peak = peak_rss_mb()
    return {"peak_mb": peak, "rise_mb": peak - before}


def prefix_gap(model, prompts, completions) -> float:
    """Largest |log-prob| gap of the shared forward to the model's own (no gradients)."""
    with torch.no_grad():
        own = own_forward_logprobs(model, *group_rows(prompts, completions))
        shared = torch.cat(turbogrpo.completion_logprobs(model, prompts, completions, backend="cascade")[0])
    return (own - shared).abs().max().item()


def tree_gap(model, batches: TreeMicroBatches) -> float:
    """Largest |log-prob| gap of the trie forward to the model's own, sequence by sequence (no gradients)."""
    with torch.no_grad():
        rows = per_sequence(batches.row_logprobs(model), batches.loss_masks)
        tree = per_sequence(batches.tree_logprobs(model), batches.loss_masks)
    return max((rows[i] - tree[i]).abs().max().item() for i in rows)


# ---------------------------------------------------------------- (a) prefix


def prefix_prompts(quick: bool, vocab: int) -> dict[str, tuple[list[torch.Tensor], list[list[torch.Tensor]]]]:
    """(prompts, completions) per prompt kind: GSM8K chat prompts in SmolLM2's ids, or (``quick``) random ids."""
    generator = torch.Generator().manual_seed(0)
    if quick:
        return {kind: ([torch.randint(0, vocab, (P,), generator=generator)],
                       [[torch.randint(0, vocab, (S,), generator=generator) for _ in range(G)]])
                for kind, (P, S, G) in QUICK_PREFIX_SHAPES.items()}
    from real_model import chat_prompts, load_real_model
    _, tokenizer = load_real_model()
    return {kind: (chat_prompts(tokenizer, 1, few_shot=kind == "few-shot"),
                   [[torch.randint(0, vocab, (COMPLETION_LEN,), generator=generator) for _ in range(GROUP)]])
            for kind in ("few-shot", "zero-shot")}


def bench_prefix(model, quick: bool, repeats: int, warmup: int) -> list[dict]:
    flops, records = HybridFlops.of(model), []
    for kind, (prompts, completions) in prefix_prompts(quick, model.config.vocab_size).items():
        P, S, G = prompts[0].numel(), completions[0][0].numel(), len(completions[0])
        gap = prefix_gap(model, prompts, completions)
        for dtype in (torch.float32, torch.bfloat16):
            autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)

            def step(fn):
                def run():
                    model.zero_grad(set_to_none=True)
                    with autocast:
                        fn(model, prompts, completions)
                return run
            times = interleaved_medians({"standard": step(run_standard), "shared": step(run_shared)},
                                        repeats=repeats, warmup=warmup)
            speedup = times["standard"]["median_s"] / times["shared"]["median_s"]
            ratio = flops.prefix_ratio(P, S, G)
            records.append({"prompt": kind, "dtype": str(dtype).removeprefix("torch."), "prompt_len": P,
                            "completion_len": S, "group_size": G, "times": times, "speedup": speedup,
                            "flop_ratio": ratio, "speedup_over_flop_ratio": speedup / ratio,
                            "max_abs_logprob_gap_float32": gap})
            print(f"done prefix {kind} {dtype}", flush=True)
    return records


# ---------------------------------------------------------------- (b) tree


def calculator_case() -> Case:
    """K x G calculator conversations (rollout.branching ``TREE_BRANCHING``) sampled by SmolLM2 (module docstring)."""
    from multiturn import calculator_run
    from tree_real import case_of
    with tempfile.TemporaryDirectory() as workdir:
        run, _ = calculator_run(Path(workdir), TREE_PROMPTS, TREE_GENERATIONS,
                                (f"rollout.branching={TREE_BRANCHING}",))
        run.policy.eval()
        episodes = run.episodes.sample(run.policy, run.tokenizer, next(run.batches), num_samples=TREE_GENERATIONS,
                                       sampling=run.sampling, seed=0, schedule=run.decode_schedule)
    return case_of(episodes)


def memory_and_gradient_gap(model, steps: dict) -> tuple[dict[str, dict[str, float]], float]:
    """One call of each of the two ``steps`` (forward + backward, gradients set anew): each one's peak memory
    (:func:`peak_memory_mb`), and the norm of their gradients' difference relative to the second's (all parameters
    as one vector: in float32 a parameter whose gradient is ~1e-6 of the others', as the DeltaNet decays' are here,
    differs in its leading digits between any two summation orders)."""
    memory, grads = {}, {}
    for name, step in steps.items():
        memory[name] = peak_memory_mb(step)
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()])
    first, second = grads.values()
    return memory, ((first - second).norm() / second.norm()).item()


def bench_tree(model, quick: bool, repeats: int, warmup: int, budget: int | None = None) -> list[dict]:
    case = (Case.synthetic(QUICK_TREE_SHAPE, vocab=model.config.vocab_size) if quick else calculator_case())
    budget = budget or (QUICK_MICRO_BATCH_TOKENS if quick else TREE_MICRO_BATCH_TOKENS)
    trie, batches = case.trie, TreeMicroBatches.of(case.trie, budget)
    gap = tree_gap(model, batches)
    steps = {name: (lambda fn=fn: (model.zero_grad(set_to_none=True), fn(model, batches)))
             for name, fn in (("rows", run_rows), ("tree", run_tree))}
    memory, grad_gap = memory_and_gradient_gap(model, steps)   # (also the warm-up of each)
    times = interleaved_medians(steps, repeats=repeats, warmup=max(warmup - 1, 0))
    speedup = times["rows"]["median_s"] / times["tree"]["median_s"]
    ratio = HybridFlops.of(model).tree_ratio(trie, [t for _, t in batches.tries])
    print("done tree", flush=True)
    return [{"case": QUICK_TREE_SHAPE if quick else
             f"calculator {TREE_PROMPTS} x {TREE_GENERATIONS}, branching {TREE_BRANCHING}",
             "sequences": trie.num_sequences, "row_tokens": trie.num_row_tokens, "trie_tokens": trie.num_tokens,
             "micro_batch_tokens": budget,
             "micro_batches": {"rows": len(batches.rows), "tree": len(batches.tries)},
             "padded_row_tokens": sum(len(rows) * len(batches.sequences[rows[0]]) for rows in batches.rows),
             "micro_batched_trie_tokens": sum(t.num_tokens for _, t in batches.tries),
             "peak_memory_mb": {name: m["peak_mb"] for name, m in memory.items()},
             "memory_rise_mb": {name: m["rise_mb"] for name, m in memory.items()},
             "peak_memory_method": "VmHWM after clear_refs over one forward + backward, in this process",
             "times": times, "speedup": speedup, "flop_ratio": ratio, "speedup_over_flop_ratio": speedup / ratio,
             "max_abs_logprob_gap_float32": gap, "relative_grad_gap_float32": grad_gap}]


PARTS = {"prefix": bench_prefix, "tree": bench_tree}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny hybrid, tiny shapes, 1 repeat, no warm-up")
    parser.add_argument("--parts", default="prefix,tree", help="comma-separated: prefix, tree")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="", help="results/<OUT>.json (default: hybrid_prefix, hybrid_prefix_quick "
                                                  "with --quick, hybrid_prefix_partial for some parts)")
    parser.add_argument("--micro-batch-tokens", type=int, default=0,
                        help=f"(b)'s micro-batch budget, padded row tokens or trie tokens (0: "
                             f"{TREE_MICRO_BATCH_TOKENS}, --quick {QUICK_MICRO_BATCH_TOKENS})")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"--parts: unknown {sorted(unknown)}; choose from {sorted(PARTS)}")
    repeats, warmup = (1, 0) if args.quick else (args.repeats, 1)
    settings = QUICK_MODEL if args.quick else HYBRID_MODEL
    model = hybrid_model(settings)
    load_before = os.getloadavg()
    results = {"model": {"type": "qwen3_5_text", "weights": "random (speed does not depend on them)",
                         "parameters": sum(p.numel() for p in model.parameters()), **settings,
                         "full_attention_every": FULL_ATTENTION_EVERY},
               "repeats": repeats, "warmup": warmup, "load_average_before": load_before}
    name = args.out or ("hybrid_prefix_quick" if args.quick else "hybrid_prefix" if len(parts) == len(PARTS)
                        else "hybrid_prefix_partial")
    for part in parts:
        options = {"budget": args.micro_batch_tokens} if part == "tree" else {}
        results[part] = PARTS[part](model, args.quick, repeats, warmup, **options)
        results["load_average_after"] = os.getloadavg()
        write_results(name, results)   # after every part, so an interrupted run keeps what it measured
    rows = [[f"{r['prompt']} {r['dtype']}", f"{r['prompt_len']}/{r['completion_len']}/{r['group_size']}",
             r["times"]["standard"]["median_s"], r["times"]["shared"]["median_s"], r["speedup"], r["flop_ratio"],
             r["speedup_over_flop_ratio"], f"{r['max_abs_logprob_gap_float32']:.1e}"]
            for r in results.get("prefix", [])]
    rows += [[f"tree: {r['case']}", f"{r['row_tokens']} -> {r['trie_tokens']} tokens", r["times"]["rows"]["median_s"],
              r["times"]["tree"]["median_s"], r["speedup"], r["flop_ratio"], r["speedup_over_flop_ratio"],
              f"{r['max_abs_logprob_gap_float32']:.1e}"] for r in results.get("tree", [])]
    for r in results.get("tree", []):
        print(f"tree micro-batches of {r['micro_batch_tokens']} tokens: rows {r['micro_batches']['rows']} "
              f"(peak {r['peak_memory_mb']['rows']:.0f} MB, +{r['memory_rise_mb']['rows']:.0f}), tree "
              f"{r['micro_batches']['tree']} (peak {r['peak_memory_mb']['tree']:.0f} MB, +{r['memory_rise_mb']['tree']:.0f});"
              f" gradients |rows - tree| / |tree| = {r['relative_grad_gap_float32']:.1e}")
    print_table(f"fwd+bwd seconds (median of {repeats}), Qwen3.5-shaped hybrid, random weights, "
                f"{results['model']['parameters'] / 1e6:.1f}M parameters",
                ["case", "P/S/G", "own forward", "turbogrpo", "speedup", "FLOP ratio", "speedup / FLOP", "max |dlogp|"],
                rows)
    print(f"load average before {load_before}, after {os.getloadavg()}")


if __name__ == "__main__":
    main()
