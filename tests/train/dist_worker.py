"""Worker of tests/train/test_distributed.py: one rank of a 2-process gloo job on CPU."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from turbogrpo.algo import LOSSES, build_loss
from turbogrpo.config import AlgoConfig, load_config
from turbogrpo.prefix import compute_logprobs
from turbogrpo.placement import join_job, leave_job
from turbogrpo.train import distributed, loop
from turbogrpo.placement import DistInfo
from turbogrpo.batch import Groups
from turbogrpo.train.update import update_policy

from .conftest import exact_tiny_model, random_step_batch
from .tiny_run import overrides

PROMPT_LENGTHS = [5, 9, 3, 7]
COMPLETION_LENGTHS = [[4, 1, 6], [2, 8, 3], [5, 5, 1], [7, 2, 2]]  # 3 completions per prompt
BUDGET = 20  # rank 0 gets 3 micro-batches (group 1 is cut in two) and rank 1 gets 2 with these lengths: fillers are exercised


def global_batch(vocab: int = 64) -> Groups:
    return random_step_batch(PROMPT_LENGTHS, COMPLETION_LENGTHS, vocab=vocab, seed=11, logp_center=-4,
                             logp_spread=0.05)


def shard(batch: Groups, dist: DistInfo) -> Groups:
    groups = distributed.local_slice(len(batch.prompts), dist)
    return batch.select(range(groups.start, groups.stop))


def two_updates(loss_name: str, strategy: str, dist: DistInfo,
                batch: Groups | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Parameters after two AdamW steps on this rank's share of the global batch (all of it on one process);
    ``batch``: the global batch (default :func:`global_batch`)."""
    model = exact_tiny_model(seed=5)
    trainer = distributed.wrap_for_training(model, compute_logprobs, dist, strategy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    batch = shard(global_batch() if batch is None else batch, dist)
    config = load_config(None, [f"train.micro_batch_tokens={BUDGET}", "rollout.max_new_tokens=8"])
    micro_batches = loop.plan(batch, config.train.micro_batch_tokens, dist)
    normalizer = loop.step_normalizer(batch, config.rollout.max_new_tokens, dist)
    metrics = []
    for _ in range(2):
        loss = build_loss(AlgoConfig(loss=loss_name, beta=0.05))
        out = update_policy(trainer, micro_batches, loss, normalizer, optimizer, max_grad_norm=0.5, dist=dist)
        metrics.append({"grad_norm": out.grad_norm, **out.metrics, "num_micro_batches": len(micro_batches)})
    params = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return params, metrics


def run(rank: int, world_size: int, ports: list[int], out_dir: str, model_dir: str, rows: str) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[0])})
    torch.set_num_threads(1)
    out = Path(out_dir)
    dist = join_job("cpu", "gloo")
    results = {}
    for strategy, losses in (("ddp", sorted(LOSSES)), ("fsdp2", ["dapo"])):
        for loss_name in losses:
            params, metrics = two_updates(loss_name, strategy, dist)
            if dist.is_main:
                save_file({k: v.contiguous() for k, v in params.items()}, out / f"{strategy}-{loss_name}.safetensors")
                results[f"{strategy}-{loss_name}"] = metrics
    if dist.is_main:
        (out / "metrics.json").write_text(json.dumps(results))
    leave_job(dist)

    # The whole loop, distributed: each rank rolls out half the prompts; checkpoints, eval, export;
    # then the FSDP2 run is resumed from its checkpoint for one more step. Last, FSDP2 in bf16-mixed
    # (float32 shards, bf16 gathers) with the TIS correction.
    bf16 = {"model.dtype": "bfloat16", "algo.tis_cap": 2.0}
    runs = [("ddp", 2, False, {}), ("fsdp2", 2, False, {}), ("fsdp2", 3, True, {}), ("fsdp2", 2, False, bf16)]
    for port, (strategy, num_steps, resume, extra) in zip(ports[1:], runs):
        os.environ["MASTER_PORT"] = str(port)
        name = f"train-{strategy}" + ("-bf16" if extra else "")
        config = load_config(None, overrides(Path(model_dir), Path(rows), out / name,
                                             **{"distributed.strategy": strategy, "train.num_steps": num_steps,
                                                "algo.beta": 0.05, **extra}))
        loop.train(config, resume=resume)


# Ranks that disagree: rank 1 trains with these settings changed (rank 0 with the shared ones). "rows" is a
# relative data.path that each rank reads in its own working folder: the same setting, other rows on rank 1.
DISAGREEMENTS = {"optim.lr": {"optim.lr": 1e-3}, "data.num_train_problems": {"data.num_train_problems": 100},
                 "rewards.0.weight": {"rewards.0.weight": 2.0},
                 "rollout.num_generations": {"rollout.num_generations": 2}, "rows": {}}


def disagreeing(rank: int, world_size: int, ports: list[int], out_dir: str, model_dir: str, rows: str) -> None:
    """Each case of DISAGREEMENTS started on both ranks; writes what each rank raised (or "started") to
    ``<out_dir>/<case>-rank<r>.txt``."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1"})
    torch.set_num_threads(1)
    out = Path(out_dir)
    own = out / f"rank{rank}"
    own.mkdir()
    lines = Path(rows).read_text().splitlines(keepends=True)
    (own / "rows.jsonl").write_text("".join(lines[::-1] if rank else lines))  # the same rows, another order
    os.chdir(own)
    for port, (case, changed) in zip(ports, DISAGREEMENTS.items()):
        os.environ["MASTER_PORT"] = str(port)
        data = {"data.path": '"rows.jsonl"', "data.eval_path": '""'} if case == "rows" else {}
        sets = {**data, **(changed if rank else {})}
        config = load_config(None, overrides(Path(model_dir), Path(rows), out / case, **sets))
        try:
            loop.train(config)
            outcome = "started"
        except ValueError as err:
            outcome = str(err)
            (out / f"{case}-rank{rank}-reports.txt").write_text(str(getattr(err, "report", None)))
        (out / f"{case}-rank{rank}.txt").write_text(outcome)


def multiturn(rank: int, world_size: int, ports: list[int], out_dir: str) -> None:
    """Multi-turn on 2 ranks: DDP updates on a global batch of conversations (environment ids masked), then
    the shipped multi-turn config (an [env] environment per conversation, on each rank) trained for a step.
    Writes the update's parameters, and per rank and step the parameters after the step and the prompts and
    completions the rank's rollout made."""
    from tests.train.test_multiturn_run import CONFIG, small
    from tests.train.test_multiturn_training import multiturn_batch

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[0])})
    torch.set_num_threads(1)
    out = Path(out_dir)
    dist = join_job("cpu", "gloo")
    params, metrics = two_updates("dapo", "ddp", dist, multiturn_batch())
    if dist.is_main:
        save_file({k: v.contiguous() for k, v in params.items()}, out / "multiturn-update.safetensors")
        (out / "multiturn-update.json").write_text(json.dumps(metrics))
    leave_job(dist)

    sample, grpo_step = loop.sample, loop.grpo_step

    def recording_sample(run, data):
        data = sample(run, data)
        rollout = {"prompts": [p.tolist() for p in data.batch.prompts],
                   "completions": [c.tolist() for c in data.batch.completions],
                   "env_tokens": sum(int((~m).sum()) for m in data.batch.model_mask)}
        (out / f"rollout-step{data.index}-rank{rank}.json").write_text(json.dumps(rollout))
        return data

    def recording_step(run, step):
        metrics = grpo_step(run, step)
        weights = {k: v.detach().clone().contiguous() for k, v in run.policy.state_dict().items()}
        save_file(weights, out / f"params-step{step + 1}-rank{rank}.safetensors")
        return metrics

    loop.sample, loop.grpo_step = recording_sample, recording_step
    os.environ["MASTER_PORT"] = str(ports[1])
    loop.train(load_config(CONFIG, small(out / "run", **{"distributed.strategy": "ddp", "train.prompts_per_step": 4,
                                                         "train.num_steps": 1})))


ASYNCHRONOUS = {"train.num_steps": 3, "train.max_staleness": 1, "algo.tis_cap": 2, "train.num_threads": 1,
                "train.rollout_threads": 1, "train.checkpoint_every": 2, "model.linear_kernel": '"module"'}
"""The asynchronous runs' settings (model.linear_kernel fixed: "auto" times each process's own matmuls)."""


def remote_workers(rollout_port: int) -> dict:
    """The settings of a run whose ranks wait for remote rollout workers on rollout_port + rank."""
    return {"train.rollout_worker": '"remote"', "train.rollout_port": rollout_port,
            "train.rollout_connect_timeout_s": 120}


def asynchronous(rank: int, world_size: int, ports: list[int], out_dir: str, model_dir: str, rows: str,
                 rollout_port: int = 0) -> None:
    """DDP with train.max_staleness = 1: each rank starts its own rollout worker for its own prompts (into run/);
    with ``rollout_port``, each rank waits for the remote worker started for it (into remote/)."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[0])})
    extra = remote_workers(rollout_port) if rollout_port else {}
    config = load_config(None, overrides(Path(model_dir), Path(rows), Path(out_dir) / ("remote" if extra else "run"),
                                         **ASYNCHRONOUS, **extra))
    loop.train(config)
