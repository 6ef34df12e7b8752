"""Which kernel multiplies a decoding step's few rows by every weight of the model fastest on this machine
(issue 54: the compiled plain step at live batch 1 within 1.5x of the weight-read floor).

At live batch 1 a step reads every weight once and does almost no arithmetic on it, so its weight products
can run no faster than the weights' bytes over this machine's read bandwidth. On the 2-core AMD EPYC (AVX-512)
the compiled step's products (aten's ``F.linear``: MKL's sgemm) read the weights at 11 GB/s against 27.8 GB/s of
measured read bandwidth (``streamed_products_s`` of ``bench/results/compiled_step_f32_b1_marked_once.json``, which
times the modules as they are); the eager step's packed oneDNN products (``turbogrpo.linears``) read them near
that bandwidth on a quiet machine (19.4 ms at one row, ``decode_ops_linears``). This benchmark times each candidate kernel over SmolLM2-135M's weight shapes (from its config:
30 layers of q, k, v, o, gate, up, down and the tied 49,152-row LM head; random values, so that every weight
streams from memory as in a real step) at 1, 2, 4 and 8 rows, float32 and bf16, 1 and 2 threads, all
contenders alternated in one process (``harness.interleaved_medians``), against the memory-read floor measured
in the same process at the same thread count (``real_model.memory_read_gbps``).

Candidates (``CANDIDATES``; each also with each layer's q/k/v and gate/up stacked into one weight, "+fused"):

    aten_linear        F.linear on the weight as it is, [out, in] (what inductor's compiled step runs; MKL's
                       sgemm in float32, oneDNN's matmul in bf16)
    onednn_packed      oneDNN on a packed copy of the weight (the eager rollout's kernel; "+fused" is what it runs)
    onednn_packed_rows oneDNN on a copy packed for this row count (``_reorder_linear_weight``'s batch-size hint)
    mm_transposed      torch.mm with the weight pre-transposed, [in, out] contiguous
    mv / mv_transposed torch.mv on [out, in] / on the transposed copy's [in, out] read as [out, in] (1 row only)
    mkl_packed         MKL's packed sgemm (``torch.ops.mkl._mkl_linear``, packed for this row count; float32)
    inductor_reduction the product written as a multiply and a sum over ``in`` (``graph_linears.reduction_product``),
                       compiled by inductor into one vectorised loop that reads each weight row once (float32
                       sums; compiled once per shape): what ``compiled-onednn`` runs at one row where it pays

Activations are in the weights' dtype (bf16 weights multiply bf16 activations, as a bf16 model's step does;
the kernels accumulate in float32). Each kernel's product of the first weight is checked against float64
(``max_rel_error``). ``GB/s`` is the weights' bytes over the median time of one pass over all of them.

    python bench/gemv_kernels.py                 # float32 and bf16, rows 1-8, threads 1 and 2; ~6-10 min on 2 cores, ~7 GB
    python bench/gemv_kernels.py --dtypes float32 --rows 1 --threads 2
    python bench/gemv_kernels.py --quick         # smoke: 2 layers and the head, 1 row, 2 repeats
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved_medians, print_table, write_results  # noqa: E402
from real_model import memory_read_gbps, real_model_folder  # noqa: E402

from turbogrpo.cpu_capability import cpu_capability  # noqa: E402
from turbogrpo.graph_linears import reduction_product  # noqa: E402
from turbogrpo.linears import onednn_product, pack_weight  # noqa: E402

Product = Callable[[torch.Tensor], torch.Tensor]
"""x [rows, in] -> x @ W.T [rows, out] (any strides)."""
CURRENT = "onednn_packed+fused"
"""What the eager rollout runs today (``linears.onednn_linears``): every ratio is against it."""


# --- the model's weights, in the order a step multiplies by them ------------------------------------------

@dataclass(frozen=True)
class WeightShapes:
    """SmolLM2's per-layer weights ``name -> (out, in)``, how many layers, and the LM head's (out, in)."""

    layer: dict[str, tuple[int, int]]
    num_layers: int
    head: tuple[int, int]

    @property
    def num_elements(self) -> int:
        return sum(o * i for o, i in self.layer.values()) * self.num_layers + self.head[0] * self.head[1]


SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Each set reads one input; "+fused" stacks its weights along the output rows (``linears.FUSED_SIBLINGS``)."""


def smollm2_shapes(num_layers: int | None = None) -> WeightShapes:
    """The real model's weight shapes, from its config (``num_layers``: fewer layers, for a smoke run)."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(real_model_folder())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, inner = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layer = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
             "gate_proj": (inner, hidden), "up_proj": (inner, hidden), "down_proj": (hidden, inner)}
    return WeightShapes(layer, num_layers or config.num_hidden_layers, (config.vocab_size, hidden))


def step_weights(shapes: WeightShapes, dtype: torch.dtype, fused: bool) -> list[torch.Tensor]:
    """Every weight ``[out, in]`` a step multiplies by, in order (siblings stacked when ``fused``), random values."""
    generator = torch.Generator().manual_seed(0)
    groups = list(SIBLINGS) if fused else []
    grouped = {name for names in groups for name in names}
    order = [*groups, *((name,) for name in shapes.layer if name not in grouped)]
    weights = []
    for _ in range(shapes.num_layers):
        for names in order:
            rows = sum(shapes.layer[n][0] for n in names)
            weights.append(torch.randn(rows, shapes.layer[names[0]][1], generator=generator).div_(30).to(dtype))
    weights.append(torch.randn(*shapes.head, generator=generator).div_(30).to(dtype))
    return weights


# --- the candidates -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Candidate:
    """One way to multiply ``rows`` rows by a weight: ``prepare(weight [out, in], rows)`` makes (untimed) what it
    needs, a ``Product``; ``runs(dtype, rows)`` says where it applies."""

    prepare: Callable[[torch.Tensor, int], Product]
    runs: Callable[[torch.dtype, int], bool] = lambda dtype, rows: True


def _aten_linear(weight: torch.Tensor, rows: int) -> Product:
    return functools.partial(F.linear, weight=weight)


def _onednn_packed(weight: torch.Tensor, rows: int) -> Product:
    packed = pack_weight(weight)
    return lambda x: onednn_product(x, packed)


def _onednn_packed_rows(weight: torch.Tensor, rows: int) -> Product:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    return lambda x: onednn_product(x, packed)


def _mm_transposed(weight: torch.Tensor, rows: int) -> Product:
    transposed = weight.t().contiguous()  # [in, out]
    return lambda x: torch.mm(x, transposed)


def _mv(weight: torch.Tensor, rows: int) -> Product:
    return lambda x: torch.mv(weight, x[0])[None]


def _mv_transposed(weight: torch.Tensor, rows: int) -> Product:
    columns = weight.t().contiguous().t()  # [out, in] stored column by column
    return lambda x: torch.mv(columns, x[0])[None]


def _mkl_packed(weight: torch.Tensor, rows: int) -> Product:
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
    return lambda x: torch.ops.mkl._mkl_linear(x, packed, weight, None, rows)


def _mkl_runs(dtype: torch.dtype, rows: int) -> bool:
    return dtype == torch.float32 and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


@functools.cache
def _compiled_reduction(out: int, inner: int, rows: int, dtype: torch.dtype) -> Callable:
    """``reduction_product`` traced and compiled by inductor for one shape, without dynamo: a dynamo-compiled
    function keeps one cache entry per shape and checks their guards in turn at every call (a dozen shapes
    here), which would time the guards."""
    from torch.fx.experimental.proxy_tensor import make_fx
    example = torch.zeros(rows, inner, dtype=dtype), torch.zeros(out, inner, dtype=dtype)
    return torch._inductor.compile(make_fx(reduction_product)(*example), list(example))


def _inductor_reduction(weight: torch.Tensor, rows: int) -> Product:
    compiled = _compiled_reduction(*weight.shape, rows, weight.dtype)
    return lambda x: compiled(x, weight)


CANDIDATES: dict[str, Candidate] = {
    "aten_linear": Candidate(_aten_linear),
    "onednn_packed": Candidate(_onednn_packed, lambda dtype, rows: cpu_capability().packs(dtype)),
    "onednn_packed_rows": Candidate(_onednn_packed_rows, lambda dtype, rows: cpu_capability().packs(dtype)),
    "mm_transposed": Candidate(_mm_transposed),
    "mv": Candidate(_mv, lambda dtype, rows: rows == 1),
    "mv_transposed": Candidate(_mv_transposed, lambda dtype, rows: rows == 1),
    "mkl_packed": Candidate(_mkl_packed, _mkl_runs),
    "inductor_reduction": Candidate(_inductor_reduction),
}
"""Name -> candidate kernel (the module docstring says what each is)."""


# --- one pass over every weight ----------------------------------------------------------------------------

class WeightPass:
    """One candidate's pass over every weight of a step at ``rows`` rows, on ``threads`` threads: its products,
    prepared once, each fed one fixed input per width (siblings read the same input, as in a step)."""

    def __init__(self, products: list[Product], widths: list[int], rows: int, dtype: torch.dtype, threads: int):
        generator = torch.Generator().manual_seed(1)
        inputs = {w: torch.randn(rows, w, generator=generator).to(dtype) for w in set(widths)}
        self.calls = [(product, inputs[width]) for product, width in zip(products, widths)]
        self.threads = threads

    def __call__(self) -> None:
        torch.set_num_threads(self.threads)
        for product, x in self.calls:
            product(x)


def max_rel_error(product: Product, weight: torch.Tensor, rows: int) -> float:
    """The largest error of ``product`` against float64 on one weight, relative to the largest output."""
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(2)).to(weight.dtype)
    truth = x.double() @ weight.double().t()
    return ((product(x).double() - truth).abs().max() / truth.abs().max()).item()


def contender_name(candidate: str, fused: bool, threads: int) -> str:
    return f"{candidate}{'+fused' if fused else ''}@{threads}"


def bench_rows(shapes: WeightShapes, dtype: torch.dtype, rows: int, threads: list[int], repeats: int,
               candidates: list[str]) -> dict:
    """Every applicable candidate, unfused and fused, at each thread count, alternated; GB/s and error each."""
    passes, errors = {}, {}
    for fused in (False, True):
        weights = step_weights(shapes, dtype, fused)
        for name in candidates:
            if not CANDIDATES[name].runs(dtype, rows):
                continue
            products = [CANDIDATES[name].prepare(w, rows) for w in weights]
            errors[name + ("+fused" if fused else "")] = max_rel_error(products[0], weights[0], rows)
            for t in threads:
                passes[contender_name(name, fused, t)] = WeightPass(products, [w.shape[1] for w in weights], rows,
                                                                    dtype, t)
    times = interleaved_medians(passes, repeats=repeats, warmup=1)
    num_bytes = shapes.num_elements * torch.finfo(dtype).bits // 8
    entry = {}
    for contender, timing in times.items():
        kernel, t = contender.rsplit("@", 1)
        entry[contender] = {"kernel": kernel, "threads": int(t), "median_s": timing["median_s"],
                            "min_s": timing["min_s"], "gbps": num_bytes / timing["median_s"] / 1e9,
                            "max_rel_error": errors[kernel]}
    return entry


def bench_dtype(shapes: WeightShapes, dtype: torch.dtype, rows_list: list[int], threads: list[int], repeats: int,
                candidates: list[str]) -> dict:
    num_bytes = shapes.num_elements * torch.finfo(dtype).bits // 8
    bandwidth = {}
    for t in threads:
        torch.set_num_threads(t)
        bandwidth[str(t)] = memory_read_gbps()
    record = {"dtype": str(dtype).removeprefix("torch."), "activations": str(dtype).removeprefix("torch."),
              "weight_bytes": num_bytes, "memory_read_gbps": bandwidth,
              "weight_read_s": {t: num_bytes / gbps / 1e9 for t, gbps in bandwidth.items()}, "rows": {}}
    for rows in rows_list:
        entry = bench_rows(shapes, dtype, rows, threads, repeats, candidates)
        for timing in entry.values():
            timing["x_floor"] = timing["median_s"] / record["weight_read_s"][str(timing["threads"])]
        current = min((v["median_s"] for v in entry.values() if v["kernel"] == CURRENT), default=None)
        for timing in entry.values():
            timing["vs_current"] = current / timing["median_s"] if current else None
        best = min(entry, key=lambda c: entry[c]["median_s"])
        record["rows"][str(rows)] = {"contenders": entry, "best": best}
    return record


def rows_of(record: dict) -> list[list]:
    table = []
    for rows, entry in record["rows"].items():
        for contender, t in sorted(entry["contenders"].items(), key=lambda item: item[1]["median_s"]):
            table.append([record["dtype"], int(rows), t["kernel"], t["threads"], t["median_s"] * 1e3, t["gbps"],
                          t["x_floor"], t["vs_current"] or "", t["max_rel_error"],
                          "best" if contender == entry["best"] else ""])
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help=f"any of {', '.join(CANDIDATES)}")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="smoke: 2 layers and the head, 1 row, 2 repeats")
    parser.add_argument("--out", default=None, help="results name (default gemv_kernels[_quick])")
    args = parser.parse_args()
    candidates = args.candidates.split(",")
    if not set(candidates) <= set(CANDIDATES) or "onednn_packed" not in candidates:
        parser.error(f"--candidates: onednn_packed (the baseline) and any of {', '.join(CANDIDATES)}")
    if args.quick:
        args.rows, args.repeats = "1", 2
    rows_list, threads = [int(r) for r in args.rows.split(",")], [int(t) for t in args.threads.split(",")]
    if min(rows_list) < 1 or min(threads) < 1:
        parser.error("--rows and --threads: positive integers")
    shapes = smollm2_shapes(2 if args.quick else None)
    name = args.out or ("gemv_kernels" + ("_quick" if args.quick else ""))
    shape = {"model": "smollm2-135m-instruct (config shapes, random weights)", "layers": shapes.num_layers,
             "layer_weights": shapes.layer, "lm_head": shapes.head, "rows": rows_list, "threads": threads,
             "repeats": args.repeats, "candidates": candidates}
    load_before, records = os.getloadavg(), []
    with torch.no_grad():
        for dtype in args.dtypes.split(","):
            records.append(bench_dtype(shapes, getattr(torch, dtype), rows_list, threads, args.repeats, candidates))
            write_results(name, {"shape": shape, "results": records,
                                 "best": {r["dtype"]: {rows: e["best"] for rows, e in r["rows"].items()} for r in records},
                                 "load_average": {"before": load_before, "after": os.getloadavg()}})
    print_table(f"Weight products of one SmolLM2-135M step ({shapes.num_layers} layers + head; medians of "
                f"{args.repeats})", ["dtype", "rows", "kernel", "threads", "ms", "GB/s", "x floor",
                                     f"{CURRENT} / this", "max rel err", ""], [row for r in records for row in rows_of(r)])
    for r in records:
        print(f"{r['dtype']}: weights {r['weight_bytes'] / 1e6:.0f} MB, memory read "
              + ", ".join(f"{g:.1f} GB/s on {t} thread(s)" for t, g in r["memory_read_gbps"].items()))


if __name__ == "__main__":
    main()
