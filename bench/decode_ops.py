"""Per-step operations of decoding, each against the version it replaced, at SmolLM2's decode shapes.

* KV-cache write (``rollout.kv_cache.write_slots``: one ``index_put_`` on the slot-major view) against
  ``scatter_`` along the slot dim, in float32 and bfloat16: CPU ``scatter_`` of bfloat16 converts the
  whole destination to float32 and back. Cache ``[64, 3, 128, 64]`` (64 sequences, 3 KV heads, 128
  slots, head dim 64), one new token per sequence; a rollout makes two such writes per layer and step.
* A draft-tree level's top-K (``speculative.tree.top_proposals`` over ``Proposals``: the 4,096-token
  draft vocabulary) against padding those log-probs to SmolLM2's 49,152 tokens with -inf and taking
  the top-K there (what drafting did before), K = 4, at 16, 64 and 128 rows (B x K frontier nodes).
* The sampler's draw (``rollout.sampling.draw_from_probs``: a two-level search over 1,024-entry blocks
  for vocabularies like SmolLM2's 49,152) against one cumsum over the whole row, at 64, 32 and 4 rows.
* The weight matmuls (``turbogrpo.linears``: oneDNN on weights packed once per rollout) against
  ``F.linear`` (MKL's sgemm in torch's CPU build), float32: all 211 of SmolLM2-135M's weights (30 x q, k, v,
  o, gate, up, down and the 49,152-row LM head; random values, 538 MB, so they stream from memory as in
  a real step) at 1-64 rows (a decoding step's live batch or tree) and 512-2,048 rows (a prefill), and
  a 2048^3 product (the large-matmul rate); milliseconds per pass over all weights.
* Sibling linears (``linears.FUSED_SIBLINGS``): each layer's q/k/v and its gate/up as one product on
  their stacked packed weight against one packed product per weight, over SmolLM2's 30 layers (random
  weights, streamed from memory), at 1-64 rows; milliseconds per pass.
* A partial attention (``rollout.attention``) by CPU flash attention against batched matmuls, at
  decoding's shapes: the own-completion part of a plain step (X rows x 3 KV heads x 3 queries over L
  generated keys) and of a tree (48 queries), microseconds per call; ``partial_attention_for`` picks
  between them from these.
* The same own-completion part inside a compiled step (``own_attention_compiled``): flash and the matmuls against
  ``reduced_partial_attention`` (broadcast products that inductor fuses into one streaming kernel) and
  ``kernel_partial_attention`` (``rollout.cpu_attention``'s hand-written kernel), over 30 layers' K/V out of
  cache, float32 and bf16, 1-64 rows x 64-256 slots; milliseconds per pass.
* Parts with many queries per KV head inside a compiled step (``many_queries_compiled``): a group's prompt part
  (its live samples' queries over the prompt's keys) and a tree's own part (48 queries over committed slots and
  ancestors), CPU flash attention and the matmuls against ``kernel_partial_attention``; milliseconds per pass.

Each part's contenders run interleaved in one process, median of ``--repeats`` timings of ``--calls`` calls each.

    python bench/decode_ops.py --threads 1     # bench/results/decode_ops.json
    python bench/decode_ops.py --threads 2 --parts tree_levels --out decode_ops_tree_levels
    python bench/decode_ops.py --threads 2 --parts linears --calls 1 --out decode_ops_linears
    python bench/decode_ops.py --threads 2 --parts own_attention --out decode_ops_own_attention
    python bench/decode_ops.py --threads 2 --parts sibling_linears --calls 3 --out decode_ops_sibling_linears
    python bench/decode_ops.py --threads 2 --parts own_attention_compiled --calls 3 --out decode_ops_own_attention_kernel
    python bench/decode_ops.py --threads 2 --parts many_queries_compiled --calls 3 --out decode_ops_many_queries_kernel
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import print_table, write_results  # noqa: E402
from turbogrpo.rollout.attention import (fused_partial_attention, kernel_partial_attention,  # noqa: E402
                                         partial_attention, reduced_partial_attention)
from turbogrpo.rollout.kv_cache import write_slots  # noqa: E402
from turbogrpo.linears import onednn_product, pack_weight  # noqa: E402
from turbogrpo.rollout.sampling import _invert_cdf, draw_from_probs  # noqa: E402
from turbogrpo.speculative.tree import Proposals, top_proposals  # noqa: E402


def per_call_us(contenders: dict, calls: int, repeats: int) -> dict[str, float]:
    """Median microseconds per call of each contender, the contenders alternating repeat by repeat."""
    times = {name: [] for name in contenders}
    for fn in contenders.values():
        fn()
    for _ in range(repeats):
        for name, fn in contenders.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}


def cache_writes(calls: int, repeats: int) -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.zeros(64, 3, 128, 64, dtype=dtype)
        new = torch.randn(64, 3, 1, 64).to(dtype)
        slots = torch.randint(0, 128, (64, 1))
        # As the replaced code did: the index expanded (a view) at every write, then scatter_.
        us = per_call_us({"scatter_": lambda: cache.scatter_(2, slots[:, None, :, None].expand_as(new), new),
                          "write_slots": lambda: write_slots(cache, slots, new)}, calls, repeats)
        rows.append({"dtype": str(dtype).removeprefix("torch."), "cache_shape": [64, 3, 128, 64], **us,
                     "speedup": us["scatter_"] / us["write_slots"]})
    return rows


def draws(calls: int, repeats: int) -> list[dict]:
    rows = []
    for num_rows in (64, 32, 4):
        probs = torch.randn(num_rows, 49_152).mul(3).softmax(-1)
        uniform = torch.rand(num_rows)
        us = per_call_us({"one_cumsum": lambda: _invert_cdf(probs, uniform=uniform.unsqueeze(-1)),
                          "two_level": lambda: draw_from_probs(probs, uniform=uniform)}, calls, repeats)
        rows.append({"rows": num_rows, "vocab": 49_152, **us, "speedup": us["one_cumsum"] / us["two_level"]})
    return rows


def tree_levels(calls: int, repeats: int) -> list[dict]:
    rows = []
    vocab, draft_vocab, top_k = 49_152, 4_096, 4
    token_ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:draft_vocab]
    for num_rows in (16, 64, 128):
        subset = torch.randn(num_rows, draft_vocab).log_softmax(-1)

        def padded():
            full = subset.new_full((num_rows, vocab), float("-inf"))
            return top_proposals(full.scatter_(-1, token_ids.expand(subset.shape), subset), top_k)

        us = per_call_us({"padded": padded, "proposals": lambda: top_proposals(Proposals(subset, token_ids), top_k)},
                         calls, repeats)
        rows.append({"rows": num_rows, "vocab": vocab, "draft_vocab": draft_vocab, "top_k": top_k, **us,
                     "speedup": us["padded"] / us["proposals"]})
    return rows


def smollm2_weights() -> list[torch.Tensor]:
    """Random float32 weights ``[out, in]`` of SmolLM2-135M's 211 linear layers, in a step's order."""
    hidden, kv, mlp, layers, vocab = 576, 192, 1536, 30, 49_152
    layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (mlp, hidden), (mlp, hidden),
             (hidden, mlp)]
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=generator) * 0.02 for shape in layer * layers + [(vocab, hidden)]]


def linears(calls: int, repeats: int) -> list[dict]:
    weights = smollm2_weights()
    packed = [pack_weight(w) for w in weights]
    rows = []
    with torch.no_grad():
        for num_rows in (1, 4, 16, 32, 64, 512, 2048):
            inputs = {n: torch.randn(num_rows, n) for n in {w.shape[1] for w in weights}}
            us = per_call_us({"f_linear": lambda: [torch.nn.functional.linear(inputs[w.shape[1]], w) for w in weights],
                              "onednn_packed": lambda: [onednn_product(inputs[w.shape[1]], p)
                                                        for w, p in zip(weights, packed)]}, calls, repeats)
            ms = {name: value / 1e3 for name, value in us.items()}
            rows.append({"rows": num_rows, "weights": len(weights), **ms, "speedup": ms["f_linear"] / ms["onednn_packed"]})
        n = 2048
        a, b = torch.randn(n, n), torch.randn(n, n)
        packed_b = pack_weight(b.t().contiguous())
        us = per_call_us({"f_linear": lambda: torch.mm(a, b), "onednn_packed": lambda: onednn_product(a, packed_b)},
                         calls, repeats)
        rows.append({"rows": f"{n}^3 GFLOP/s", **{name: 2 * n ** 3 / (value * 1e3) for name, value in us.items()},
                     "speedup": us["f_linear"] / us["onednn_packed"]})
    return rows


def sibling_linears(calls: int, repeats: int) -> list[dict]:
    weights = smollm2_weights()[:-1]
    layers = [weights[i:i + 7] for i in range(0, len(weights), 7)]
    sets = {"qkv": (0, 1, 2), "gate_up": (4, 5)}
    one_by_one = {name: [[pack_weight(layer[i]) for i in members] for layer in layers] for name, members in sets.items()}
    stacked = {name: [pack_weight(torch.cat([layer[i] for i in members])) for layer in layers]
               for name, members in sets.items()}
    rows = []
    with torch.no_grad():
        for num_rows in (1, 4, 8, 16, 32, 64):
            x = torch.randn(num_rows, layers[0][0].shape[1])
            row = {"rows": num_rows}
            for name in sets:
                us = per_call_us({"one_by_one": lambda: [onednn_product(x, w) for ws in one_by_one[name] for w in ws],
                                  "stacked": lambda: [onednn_product(x, w) for w in stacked[name]]}, calls, repeats)
                row.update({f"{name}_one_by_one": us["one_by_one"] / 1e3, f"{name}_stacked": us["stacked"] / 1e3,
                            f"{name}_speedup": us["one_by_one"] / us["stacked"]})
            row["speedup"] = (row["qkv_one_by_one"] + row["gate_up_one_by_one"]) / (row["qkv_stacked"] + row["gate_up_stacked"])
            rows.append(row)
    return rows


def own_attention(calls: int, repeats: int) -> list[dict]:
    rows = []
    for num_x, num_queries, num_keys in [(32, 3, 16), (32, 3, 64), (32, 3, 128), (16, 3, 128), (8, 3, 128),
                                         (4, 3, 128), (1, 3, 128), (4, 48, 64), (1, 48, 64)]:
        query, key, value = (torch.randn(num_x, 3, n, 64) for n in (num_queries, num_keys, num_keys))
        bias = torch.zeros(num_x, 1, num_queries, num_keys)
        us = per_call_us({"flash": lambda: fused_partial_attention(query, key, value, bias, 0.125),
                          "matmuls": lambda: partial_attention(query, key, value, bias, 0.125)}, calls, repeats)
        rows.append({"rows_heads_queries_keys": f"{num_x}x3x{num_queries}x{num_keys}", **us,
                     "speedup": us["flash"] / us["matmuls"]})
    return rows


def own_attention_compiled(calls: int, repeats: int) -> list[dict]:
    """The own-completion part of a compiled plain step over SmolLM2's 30 layers (each layer's K/V its own buffer,
    a slot short of the buffer's end as the cache reads it, so a pass streams them from memory as a step does):
    CPU flash attention and the batched matmuls against ``reduced_partial_attention`` and
    ``kernel_partial_attention``, each compiled over the 30 layers as one graph."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for num_x, num_keys in [(1, 256), (4, 256), (8, 256), (16, 128), (16, 256), (64, 64), (64, 256)]:
            def layer_buffer():
                return torch.randn(num_x, 3, num_keys + 1, 64, dtype=dtype)[:, :, :num_keys]
            keys, values = [layer_buffer() for _ in range(30)], [layer_buffer() for _ in range(30)]
            query, bias = torch.randn(num_x, 3, 3, 64, dtype=dtype), torch.zeros(num_x, 1, 3, num_keys)

            def layers(partial):
                torch._dynamo.reset()  # each shape and contender its own graph (one code object: no recompile limit)
                return torch.compile(lambda: [partial(query, k, v, bias, 0.125) for k, v in zip(keys, values)],
                                     dynamic=False)
            flash_bias = bias.to(dtype)  # the fused kernel takes its bias in the query's dtype

            def flash(query, key, value, _, scale):
                return fused_partial_attention(query, key, value, flash_bias, scale)
            us = per_call_us({"flash": layers(flash), "matmuls": layers(partial_attention),
                              "reduced": layers(reduced_partial_attention),
                              "kernel": layers(kernel_partial_attention)}, calls, repeats)
            rows.append({"dtype": str(dtype).removeprefix("torch."), "rows_keys": f"{num_x}x{num_keys}",
                         "kv_mb": 2 * 30 * keys[0].numel() * keys[0].element_size() / 1e6,
                         **{name: us[name] / 1e3 for name in ("flash", "matmuls", "reduced", "kernel")},
                         "speedup": min(us["flash"], us["matmuls"]) / us["reduced"],
                         "kernel_speedup": us["reduced"] / us["kernel"]})
    return rows


def many_queries_compiled(calls: int, repeats: int) -> list[dict]:
    """Parts with many queries per KV head inside a compiled step, over SmolLM2's 30 layers (each layer's K/V its own
    buffer, read a slot short of its end): a group's prompt part (its S live samples' 3 S queries per KV head over P
    prompt keys, every key visible) and a tree's own part (16 tree tokens' 48 queries over L slots, each seeing its
    committed slots and its ancestors: a random half of the last 16). CPU flash attention and the batched matmuls
    against ``kernel_partial_attention``, each compiled over the 30 layers as one graph."""
    rows = []
    cases = [("prompt", 8, 8, 143), ("prompt", 8, 4, 143), ("prompt", 8, 1, 143), ("prompt", 4, 1, 143),
             ("prompt", 1, 1, 143), ("prompt", 1, 8, 143), ("tree", 1, 16, 160), ("tree", 4, 16, 160),
             ("tree", 16, 16, 160)]
    for dtype in (torch.float32, torch.bfloat16):
        for part, num_x, count, num_keys in cases:
            num_queries = 3 * count
            def layer_buffer():
                return torch.randn(num_x, 3, num_keys + 1, 64, dtype=dtype)[:, :, :num_keys]
            keys, values = [layer_buffer() for _ in range(30)], [layer_buffer() for _ in range(30)]
            query = torch.randn(num_x, 3, num_queries, 64, dtype=dtype)
            bias = None
            if part == "tree":
                visible = torch.ones(num_x, 1, num_queries, num_keys, dtype=torch.bool)
                visible[..., -16:] = torch.rand(num_x, 1, num_queries, 16) < 0.5
                bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))

            def layers(partial, bias):
                torch._dynamo.reset()  # each shape and contender its own graph (one code object: no recompile limit)
                return torch.compile(lambda: [partial(query, k, v, bias, 0.125) for k, v in zip(keys, values)],
                                     dynamic=False)
            us = per_call_us({"flash": layers(fused_partial_attention, None if bias is None else bias.to(dtype)),
                              "matmuls": layers(partial_attention, bias),
                              "kernel": layers(kernel_partial_attention, bias)}, calls, repeats)
            label = (f"{num_x} groups x {count} samples x {num_keys}" if part == "prompt"
                     else f"{num_x} rows x {count} tree tokens x {num_keys}")
            rows.append({"dtype": str(dtype).removeprefix("torch."), "part": part, "shape": label,
                         "kv_mb": 2 * 30 * keys[0].numel() * keys[0].element_size() / 1e6,
                         **{name: us[name] / 1e3 for name in ("flash", "matmuls", "kernel")},
                         "speedup": min(us["flash"], us["matmuls"]) / us["kernel"]})
    return rows


PARTS = {"cache_writes": cache_writes, "draws": draws, "tree_levels": tree_levels, "linears": linears,
         "own_attention": own_attention, "sibling_linears": sibling_linears,
         "own_attention_compiled": own_attention_compiled, "many_queries_compiled": many_queries_compiled}
TITLES = {"cache_writes": ("KV-cache write, one token per sequence (us per write)", ["dtype", "scatter_", "write_slots"]),
          "draws": ("Draw from [rows, 49152] probabilities (us per draw)", ["rows", "one_cumsum", "two_level"]),
          "tree_levels": ("A tree level's top-4: padded to 49152 vs the 4096-token draft vocabulary (us)",
                          ["rows", "padded", "proposals"]),
          "linears": ("SmolLM2's 211 weight matmuls, float32: F.linear vs oneDNN packed (ms per pass; last row "
                      "GFLOP/s)", ["rows", "f_linear", "onednn_packed"]),
          "sibling_linears": ("30 layers' q/k/v and gate/up, one packed product per weight vs one per stacked set "
                              "(ms per pass; speedup of both sets)",
                              ["rows", "qkv_one_by_one", "qkv_stacked", "qkv_speedup", "gate_up_one_by_one",
                               "gate_up_stacked", "gate_up_speedup"]),
          "own_attention": ("Partial attention, flash vs matmuls (us per call; speedup = flash / matmuls)",
                            ["rows_heads_queries_keys", "flash", "matmuls"]),
          "own_attention_compiled": ("Own-completion attention in a compiled step, 30 layers x rows x 3 KV heads x 3 "
                                     "queries over L slots: flash and matmuls vs reduced, and the CPU kernel (ms per pass; "
                                     "speedup: reduced over the faster of flash and matmuls; kernel_speedup: kernel "
                                     "over reduced)",
                                     ["dtype", "rows_keys", "kv_mb", "flash", "matmuls", "reduced", "kernel",
                                      "kernel_speedup"]),
          "many_queries_compiled": ("Prompt parts and tree parts in a compiled step, 30 layers x 3 KV heads: flash and "
                                    "matmuls vs the CPU kernel (ms per pass; speedup: kernel over the faster of "
                                    "flash and matmuls)", ["dtype", "part", "shape", "kv_mb", "flash", "matmuls",
                                                           "kernel"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=["cache_writes", "draws"])
    parser.add_argument("--out", default="decode_ops", help="results name under bench/results")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    results = {part: PARTS[part](args.calls, args.repeats) for part in args.parts}
    for part, rows in results.items():
        title, columns = TITLES[part]
        print_table(title, [*columns, "speedup"], [[r[c] for c in [*columns, "speedup"]] for r in rows])
    write_results(args.out, {"calls": args.calls, "repeats": args.repeats, "threads": torch.get_num_threads(),
                             **results, "load_average": {"before": load_before, "after": os.getloadavg()}})


if __name__ == "__main__":
    main()
