"""Step time and memory of one GRPO step (rollout + update) per precision mode.

    python bench/gpu_precision.py                 # CUDA: the Qwen2-0.5B shape, random init, built on the GPU
    python bench/gpu_precision.py --device cpu    # CPU: a demo-sized shape, the same modes

Modes (all but pure_bf16 keep float32 master weights and AdamW state):
    float32             float32 parameters, float32 compute.
    bf16_autocast       float32 parameters, every forward under torch.autocast(bf16) (what
                        model.dtype = "bfloat16" runs; gradients are float32).
    bf16_compute_copy   float32 masters + a bf16 copy of the model that rolls out and trains; its bf16
                        gradients are cast into the masters' .grad, AdamW steps the masters, the copy is
                        refreshed from them (the alternative the trainer was measured against).
    pure_bf16           bf16 parameters and AdamW state (model.pure_bf16 = true).

Per mode: median seconds of the rollout and of the update (interleaved across modes), the bytes per
parameter held by parameters + gradients + optimizer state (+ copy) right after the optimizer step
(counted from the tensors), and on CUDA the peak allocated memory of the step. As a module,
``run(results, budget_s)`` is bench/gpu.py's "precision" part (CUDA only; it skips without CUDA).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import interleaved_medians, print_table, write_results  # noqa: E402

from turbogrpo.algo import LOSSES, LossNormalizer  # noqa: E402
from turbogrpo.config import AlgoConfig  # noqa: E402
from turbogrpo.models import tiny_model  # noqa: E402
from turbogrpo.prefix import compute_logprobs  # noqa: E402
from turbogrpo.rollout import SamplingConfig, generate  # noqa: E402
from turbogrpo.batch import Groups, length_mask, pad_ragged  # noqa: E402
from turbogrpo.train.precision import Precision  # noqa: E402

# Qwen2-0.5B: 24 layers, hidden 896, 14 heads (2 KV), MLP 4864, vocab 151936, tied embeddings (494M parameters).
SHAPES = {
    "cuda": dict(vocab_size=151936, hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864,
                 tie_word_embeddings=True),
    "cpu": dict(vocab_size=512, hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384, tie_word_embeddings=True),
}
# A GRPO step: K prompts of P tokens, G completions of S tokens each.
STEPS = {"cuda": dict(num_prompts=4, prompt_len=256, group=8, new_tokens=64),
         "cpu": dict(num_prompts=2, prompt_len=48, group=4, new_tokens=16)}
F32, BF16 = torch.float32, torch.bfloat16


class Mode:
    """One precision mode: a model to roll out, a training forward, and the optimizer step."""

    def __init__(self, name: str, device: torch.device, shape: dict):
        self.name = name
        storage = BF16 if name == "pure_bf16" else F32
        with torch.device(device):
            self.master = tiny_model("qwen2", dtype=storage, seed=0, **shape).train()
        self.precision = Precision(F32, BF16 if name == "bf16_autocast" else storage, device.type)
        self.copy = None
        if name == "bf16_compute_copy":
            self.copy = copy.deepcopy(self.master).to(BF16)
        self.optimizer = torch.optim.AdamW(self.master.parameters(), lr=1e-6, betas=(0.9, 0.99))

    @property
    def compute_model(self):
        return self.copy if self.copy is not None else self.master

    def rollout(self, prompts, sampling, num_samples):
        with torch.no_grad(), self.precision.autocast():
            return generate(self.compute_model, prompts, num_samples=num_samples, sampling=sampling, seed=0)

    def update(self, prompts, completions, advantages):
        with self.precision.autocast():
            result = compute_logprobs(self.compute_model, prompts, completions, share_prefix=True)
        logps = Groups.from_nested(prompts, completions).per_completion(result.logps)
        mask_BL = length_mask([t.numel() for t in logps], device=logps[0].device)
        loss, _ = LOSSES["dapo"](pad_ragged(logps), None, None, advantages, mask_BL,
                                 LossNormalizer.for_batch(mask_BL, mask_BL.shape[1]), AlgoConfig())
        loss.backward()
        if self.copy is not None:  # bf16 gradients into the float32 masters
            for master, low in zip(self.master.parameters(), self.copy.parameters()):
                master.grad = low.grad.float()
                low.grad = None
        torch.nn.utils.clip_grad_norm_(self.master.parameters(), 1.0)
        self.optimizer.step()
        held = self.state_bytes()
        self.optimizer.zero_grad(set_to_none=True)
        if self.copy is not None:  # refresh the compute copy from the stepped masters
            with torch.no_grad():
                torch._foreach_copy_(list(self.copy.parameters()), list(self.master.parameters()))
        return held

    def state_bytes(self) -> int:
        """Bytes of parameters, gradients, optimizer state and compute copy, counted from the tensors."""
        tensors = [p for p in self.master.parameters()] + [p.grad for p in self.master.parameters() if p.grad is not None]
        tensors += [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        if self.copy is not None:
            tensors += list(self.copy.parameters())
        return sum(t.numel() * t.element_size() for t in tensors)


def measure(device: torch.device, repeats: int, budget_s: float) -> dict:
    shape, step = SHAPES[device.type], STEPS[device.type]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, shape["vocab_size"] - 1, (step["prompt_len"],), generator=gen).to(device)
               for _ in range(step["num_prompts"])]
    sampling = SamplingConfig(max_new_tokens=step["new_tokens"], temperature=1.0, stop_token_ids=())
    advantages = torch.randn(step["num_prompts"] * step["group"], generator=gen).to(device)
    modes, rows, held, peak, rollouts = {}, {}, {}, {}, {}
    for name in ("float32", "bf16_autocast", "bf16_compute_copy", "pure_bf16"):
        # Build and run one step each: completions for the update, and the memory figures (on CUDA the
        # peak counts everything this mode allocates: weights, copy, gradients, AdamW state, activations).
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        modes[name] = mode = Mode(name, device, shape)
        rollouts[name] = mode.rollout(prompts, sampling, step["group"]).tokens_per_group()
        held[name] = mode.update(prompts, rollouts[name], advantages)
        if device.type == "cuda":
            peak[name] = torch.cuda.max_memory_allocated() - base
    num_params = sum(p.numel() for p in modes["float32"].master.parameters())
    # Same completions for every mode's timed update (the float32 rollout's), so the update work is equal.
    completions = rollouts["float32"]
    start = time.perf_counter()
    first = interleaved_medians({name: (lambda m=mode: m.rollout(prompts, sampling, step["group"]))
                                 for name, mode in modes.items()}, repeats=1, warmup=0)
    per_round = time.perf_counter() - start
    repeats = max(1, min(repeats, int(budget_s / 2 / max(per_round, 1e-3))))
    rollout_t = interleaved_medians({name: (lambda m=mode: m.rollout(prompts, sampling, step["group"]))
                                     for name, mode in modes.items()}, repeats=repeats, warmup=0) if repeats > 1 else first
    update_t = interleaved_medians({name: (lambda m=mode: m.update(prompts, completions, advantages))
                                    for name, mode in modes.items()}, repeats=repeats, warmup=1)
    for name in modes:
        rows[name] = {"rollout_s": rollout_t[name]["median_s"], "update_s": update_t[name]["median_s"],
                      "state_bytes_per_param": held[name] / num_params}
        if name in peak:
            rows[name]["peak_step_bytes_per_param"] = peak[name] / num_params
            rows[name]["peak_step_gib"] = peak[name] / 2**30
    return {"shape": shape, "step": step, "num_params": num_params, "repeats": repeats, "modes": rows}


def table(result: dict) -> str:
    base = result["modes"]["float32"]
    columns = ["mode", "rollout s", "update s", "update vs fp32", "state B/param"]
    has_peak = "peak_step_gib" in base
    if has_peak:
        columns += ["peak GiB", "peak B/param"]
    rows = []
    for name, r in result["modes"].items():
        row = [name, round(r["rollout_s"], 3), round(r["update_s"], 3), round(r["update_s"] / base["update_s"], 2),
               round(r["state_bytes_per_param"], 1)]
        if has_peak:
            row += [round(r["peak_step_gib"], 2), round(r["peak_step_bytes_per_param"], 1)]
        rows.append(row)
    return print_table(f"one GRPO step per precision mode ({result['num_params'] / 1e6:.1f}M parameters, "
                       f"{result['step']})", columns, rows)


def run(results: dict, budget_s: float) -> None:
    """bench/gpu.py's part: the 0.5B shape on CUDA; skips cleanly without CUDA."""
    if not torch.cuda.is_available():
        results.update(status="skipped", reason="no CUDA device")
        return
    result = measure(torch.device("cuda"), repeats=3, budget_s=budget_s)
    table(result)
    results.update(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=float, default=300.0, help="seconds for the timed rounds")
    parser.add_argument("--out", default=None, help="results name (default precision_<device>)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; run with --device cpu")
        return
    if device.type == "cpu":
        torch.set_num_threads(1)
    result = measure(device, args.repeats, args.budget)
    if device.type == "cpu":
        result["note"] = ("CPU timings: compare the modes' ratios; bf16 runs at native speed only on CPUs with "
                          "AVX512-BF16/AMX (others emulate it)")
    result["table"] = table(result)
    result["command"] = "python " + " ".join(sys.argv)
    result["load_average"] = os.getloadavg()[0]  # 1-minute, at the end
    write_results(args.out or f"precision_{device.type}", result)


if __name__ == "__main__":
    main()
