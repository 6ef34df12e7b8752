"""MoE routing replay (algo.routing_replay, ``turbogrpo.moe_routes``): a bf16 sampler, a float32 trainer.

For a tiny qwen3_moe and a tiny qwen3_5_moe (random weights, float32 masters), completions are sampled by a bf16
copy of the model, which records each token's routes; the float32 trainer then scores them with the shared-prefix
forward twice, its routers choosing (no replay) and replaying the sampler's routes. Reported per family:

* route disagreement: the share of tokens whose experts differ in at least one MoE layer between the sampler's
  routers and the trainer's (what replay removes; with replay the trainer runs the sampler's experts, 0);
* the K3 estimate of KL(sampler || trainer), mean over tokens of exp(d) - d - 1 with d = logp_trainer -
  logp_sampler, and the mean |d|, without and with replay (target: K3 falls >= 10x with replay);
* bytes per token of the stored routes (L layers x k experts, uint8);
* the trainer's forward + backward time without and with replay, alternated in one process (medians).

qwen3_moe samples with the native engine (``rollout.generate(record_routes=True)``); qwen3_5_moe, a hybrid the
native engine does not decode yet, with its own bf16 forward and cache token by token (each token's routes recorded
in the forward that ran it).

    python bench/routing_replay.py           # ~2 min on 2 cores; bench/results/routing_replay.json
    python bench/routing_replay.py --quick   # seconds; bench/results/routing_replay_quick.json
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved_medians, print_table, write_results  # noqa: E402

from turbogrpo.hook import check_supported  # noqa: E402
from turbogrpo.models import tiny_moe  # noqa: E402
from turbogrpo.moe_routes import BatchRoutes, ReplayCounts, bytes_per_token, recording  # noqa: E402
from turbogrpo.prefix import compute_logprobs  # noqa: E402
from turbogrpo.rollout.decode import generate  # noqa: E402
from turbogrpo.rollout.sampling import SamplingConfig  # noqa: E402

FAMILIES = ("qwen3_moe", "qwen3_5_moe")
SHAPES = {
    # Wider than the tests' models: 16 experts choose 2, so that bf16 rounding flips some choices. Weights drawn
    # with std 0.05: at 0.02 (trained models' init) a random tiny model's outputs are nearly uniform, so neither
    # flips nor rounding move its log-probs much (K3 ~1e-6 either way); at 0.2 bf16 rounding in the gated
    # DeltaNet layers alone moves qwen3_5_moe's by K3 ~0.02, routes replayed or not.
    "full": dict(model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_experts=16,
                            moe_intermediate_size=32, vocab_size=256, eos_token_id=255, initializer_range=0.05),
                 layer_types=["linear_attention", "full_attention"] * 2,
                 num_prompts=8, num_samples=8, prompt_length=32, new_tokens=64, repeats=5),
    "quick": dict(model=dict(num_experts=8), layer_types=["linear_attention", "full_attention"],
                  num_prompts=2, num_samples=2, prompt_length=6, new_tokens=8, repeats=1),
}


def build(family: str, shape: dict) -> torch.nn.Module:
    overrides = dict(shape["model"])
    if family == "qwen3_5_moe":
        overrides["layer_types"] = shape["layer_types"]
        overrides["num_hidden_layers"] = len(shape["layer_types"])
    return tiny_moe(family, dtype=torch.float32, seed=0, **overrides)


def sample_with_engine(sampler, prompts, num_samples, new_tokens, seed):
    """The native engine in bf16: ids, sampler log-probs and routes (``Groups``)."""
    return generate(sampler, prompts, num_samples=num_samples, sampling=SamplingConfig(max_new_tokens=new_tokens),
                    seed=seed, record_routes=True).groups


def sample_with_own_forward(sampler, prompts, num_samples, new_tokens, seed):
    """Token by token with the model's own bf16 forward and its own cache (each token run once, its routes recorded
    in that forward). Returns the batch (``Groups``) with sampler log-probs and routes."""
    from turbogrpo.batch import Groups
    generator = torch.Generator().manual_seed(seed)
    completions, logps, prompt_routes, routes = [], [], [], []
    with torch.no_grad(), recording(sampler) as recorder:
        for prompt in prompts:
            out = sampler(prompt.repeat(num_samples, 1), use_cache=True)
            prompt_routes.append(recorder.take()[:prompt.numel()])   # the G rows are the same prompt
            tokens, drawn_logps, token_routes = [], [], []
            for _ in range(new_tokens):
                logprobs = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
                token = torch.multinomial(logprobs.exp(), 1, generator=generator)
                tokens.append(token)
                drawn_logps.append(logprobs.gather(1, token))
                out = sampler(token, past_key_values=out.past_key_values, use_cache=True)
                token_routes.append(recorder.take())                   # [G, L, k]: the token just drawn
            completions += list(torch.cat(tokens, dim=1))
            logps += list(torch.cat(drawn_logps, dim=1))
            routes += list(torch.stack(token_routes[:-1], dim=1))     # the last token's is never needed
    return Groups(prompts, completions, [num_samples] * len(prompts), sampler_logps=logps, routes=routes,
                  prompt_routes=prompt_routes)


def measure(family: str, shape: dict, seed: int) -> dict:
    trainer = build(family, shape)
    sampler = copy.deepcopy(trainer).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(seed)
    vocab = trainer.config.vocab_size
    prompts = [torch.randint(0, vocab - 1, (shape["prompt_length"],), generator=generator)
               for _ in range(shape["num_prompts"])]
    try:
        check_supported(sampler)
        engine = "native engine, bf16"
        batch = sample_with_engine(sampler, prompts, shape["num_samples"], shape["new_tokens"], seed)
    except ValueError:
        engine = "the model's own bf16 forward and cache (the native engine does not decode hybrids yet)"
        batch = sample_with_own_forward(sampler, prompts, shape["num_samples"], shape["new_tokens"], seed)
    sampler_logps = torch.cat(batch.sampler_logps).double()
    nested = batch.nested()

    def trainer_logps(replay: bool, counts: ReplayCounts | None = None):
        routes = batch.batch_routes._replace(counts=counts) if replay else None
        return compute_logprobs(trainer, batch.prompts, nested, share_prefix=True, with_entropy=False,
                                routes=routes).logps

    counts = ReplayCounts()
    with torch.no_grad():
        plain, replayed = trainer_logps(False).double(), trainer_logps(True, counts).double()
    result = {"sampler": engine, "num_tokens": int(sampler_logps.numel()),
              "num_replayed_tokens": int(counts.num_tokens), "bytes_per_token": bytes_per_token(trainer),
              "route_disagreement_without_replay": float(counts.num_differing) / max(int(counts.num_tokens), 1),
              "route_disagreement_with_replay": 0.0}
    for name, logps in (("without_replay", plain), ("with_replay", replayed)):
        delta = logps - sampler_logps
        result[f"k3_kl_{name}"] = float((delta.exp() - delta - 1).mean())
        result[f"abs_delta_mean_{name}"] = float(delta.abs().mean())
    result["k3_kl_ratio"] = result["k3_kl_without_replay"] / max(result["k3_kl_with_replay"], 1e-300)

    def step(replay: bool):
        trainer.zero_grad(set_to_none=True)
        trainer_logps(replay).sum().backward()

    times = interleaved_medians({"no_replay": lambda: step(False), "replay": lambda: step(True)},
                                repeats=shape["repeats"], warmup=1)
    result["forward_backward_s"] = {name: t["median_s"] for name, t in times.items()}
    result["replay_time_ratio"] = times["replay"]["median_s"] / times["no_replay"]["median_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test in seconds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shape_name = "quick" if args.quick else "full"
    shape = SHAPES[shape_name]
    load_before = os.getloadavg()
    families = {family: measure(family, shape, args.seed) for family in FAMILIES}
    print_table(f"routing replay: bf16 sampler, float32 trainer ({shape_name})",
                ["family", "tokens", "route disagreement", "K3 no replay", "K3 replay", "K3 ratio", "bytes/token",
                 "time ratio"],
                [[f, r["num_tokens"], r["route_disagreement_without_replay"], r["k3_kl_without_replay"],
                  r["k3_kl_with_replay"], r["k3_kl_ratio"], r["bytes_per_token"], r["replay_time_ratio"]]
                 for f, r in families.items()])
    write_results("routing_replay" + ("_quick" if args.quick else ""), {
        "shape": {k: v for k, v in shape.items() if k != "repeats"}, "repeats": shape["repeats"],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average": {"before": load_before, "after": os.getloadavg()}, "families": families})


if __name__ == "__main__":
    main()
