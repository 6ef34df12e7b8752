"""Multi-turn GRPO with a tool on SmolLM2-135M-Instruct: turbogrpo against the re-prefilling baselines.

The task is the shipped calculator (configs/smollm2_calculator.toml: "What is 37 * 52 - 18?", a
``calculate`` tool in the pythonic call format, up to 3 turns of at most 32 tokens, 96 ids after the
prompt), K prompts x G conversations per step at temperature 0.7, float32. Two parts, each alternating
baseline and ours run by run in one process (harness.interleaved_medians):

* rollout: ``run_episodes`` with our engine (each conversation keeps its KV cache; a tool reply is
  prefilled as new tokens only) against the same episodes (same environments, tool parsing and reply
  rendering) driven by HF ``generate``, which re-prefills every live conversation from its first token at
  each turn, as TRL's transformers path does. Reported with each side's prefilled ids per turn: ours only
  the environment's reply ids, the baseline the whole conversation so far.
* step: one whole GRPO step (rollout, rewards, advantages, loss, backward, optimizer) of turbogrpo's loop
  against TRL 1.16's ``GRPOTrainer`` with ``environment_factory`` (the same ``calculate`` tool), its
  ``max_tool_calling_iterations`` = max_turns - 1 and ``max_completion_length`` = 96. Two adapters let
  TRL run the task as shipped: the tokenizer parses the pythonic calls (TRL reads calls through
  ``tokenizer.parse_response``; ours is ``env.tool_calls.parse_pythonic``), and TRL's template probe
  ``supports_tool_calling`` is bypassed (it wants argument names in the rendered call; the pythonic
  format writes values only). TRL's reward is the same accuracy check on its final assistant message.

    python bench/multiturn.py                  # both parts: rollout 3 timed runs, step 2 timed steps each
    python bench/multiturn.py --parts rollout --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import StepMemory, TrlStepper  # noqa: E402
from harness import interleaved_medians, print_table, write_results  # noqa: E402

import turbogrpo.env.episode as episode_module  # noqa: E402
from turbogrpo.batch import Groups  # noqa: E402
from turbogrpo.config import load_config  # noqa: E402
from turbogrpo.data.tool_tasks import calculator_records  # noqa: E402
from turbogrpo.env.environment import bind_positional  # noqa: E402
from turbogrpo.env.tasks import CHAT_TEMPLATES, Calculator, last_integer  # noqa: E402
from turbogrpo.env.tool_calls import parse_pythonic  # noqa: E402
from turbogrpo.placement import join_job  # noqa: E402
from turbogrpo.rewards import build_rewards  # noqa: E402
from turbogrpo.rollout.multiturn import MultiTurnRollout, MultiTurnStats  # noqa: E402
from turbogrpo.train import loop  # noqa: E402
from turbogrpo.train.run import build_run  # noqa: E402
from turbogrpo.train.output_dir import run_record  # noqa: E402
from turbogrpo.train.state import start  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smollm2_calculator.toml"
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def calculator_run(workdir: Path, num_prompts: int, num_generations: int, overrides: tuple[str, ...] = ()):
    """turbogrpo's run of the shipped calculator config, as ``turbogrpo train`` builds it (no held-out pass);
    ``overrides``: more config settings (``key=value``), e.g. ``rollout.engine="vllm"``."""
    config = load_config(CONFIG, [
        f"train.prompts_per_step={num_prompts}", f"rollout.num_generations={num_generations}",
        f'train.output_dir="{workdir / "turbogrpo"}"', "train.num_steps=1000", "log.tensorboard=false",
        "log.progress_bar=false", "log.completions_every=0", *overrides])
    run = build_run(config, join_job("cpu"), build_rewards(config.rewards), run_record(config))
    start(run, resume=False)
    return run, config


# --- the rollout baseline: HF generate, the whole conversation prefilled again every turn ------------------


class TurnLog:
    """Per-turn counts of one rollout: live conversations, ids prefilled, seconds."""

    def __init__(self):
        self.turns: list[dict] = []


def hf_reprefill_multiturn(log: TurnLog):
    """A drop-in for ``rollout.multiturn.generate_multiturn`` (what ``run_episodes`` calls) that drives the
    same handlers with HF ``generate``: each turn, every live conversation (prompt + all ids so far) is
    left-padded into one batch and generated from scratch (a fresh KV cache) until its end-of-turn token or
    the turn's token limit; the handler's reply ids are appended as text would be re-rendered by TRL."""

    def generate_multiturn(model, prompts, handlers, *, num_samples, sampling, limits, seed=None, draft=None,
                           schedule=None, reply_timing="arrival", branching=()):
        assert draft is None and len(branching) <= 1, "the baseline runs plain, unbranched rollouts"
        start_time = time.perf_counter()
        if seed is not None:
            torch.manual_seed(seed)
        end_id = sampling.stop_token_ids[-1]
        pad_id = getattr(model.config, "pad_token_id", None) or end_id
        n = len(handlers)
        ids: list[list[int]] = [[] for _ in range(n)]
        mask: list[list[int]] = [[] for _ in range(n)]
        finish = ["stop"] * n
        turns = [0] * n
        live = list(range(n))
        stats = MultiTurnStats()
        while live:
            rows = [torch.cat([prompts[i // num_samples].cpu(), torch.tensor(ids[i], dtype=torch.long)]) for i in live]
            width = max(r.numel() for r in rows)
            input_ids = torch.stack([torch.cat([torch.full((width - r.numel(),), pad_id), r]) for r in rows])
            attention = torch.stack([torch.cat([torch.zeros(width - r.numel()), torch.ones(r.numel())]) for r in rows])
            budget = min(limits.max_turn_tokens, limits.max_conversation_tokens - min(len(ids[i]) for i in live))
            turn_start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(input_ids, attention_mask=attention.long(), do_sample=sampling.temperature > 0,
                                     temperature=sampling.temperature or None, top_k=sampling.top_k or None,
                                     top_p=sampling.top_p, max_new_tokens=max(budget, 1), eos_token_id=end_id,
                                     pad_token_id=pad_id)
            log.turns.append({"live": len(live), "prefilled_ids": int(attention.sum()),
                              "padded_ids": int(attention.numel()), "seconds": time.perf_counter() - turn_start})
            stats.num_forwards += out.shape[1] - width
            stats.live_batch_sizes.append(len(live))
            still = []
            for b, i in enumerate(live):
                new = out[b, width:].tolist()
                turn = new[:new.index(end_id) + 1] if end_id in new else new
                turn = turn[:min(limits.max_turn_tokens, limits.max_conversation_tokens - len(ids[i]))]
                ids[i] += turn
                mask[i] += [1] * len(turn)
                turns[i] += 1
                stats.num_turns += 1
                if not turn or turn[-1] != end_id:
                    finish[i] = "length"
                    continue
                reply = handlers[i](turn)
                if reply is None:
                    continue
                if len(ids[i]) + len(reply) > limits.max_conversation_tokens:
                    finish[i] = "length"
                    continue
                ids[i] += reply
                mask[i] += [0] * len(reply)
                stats.num_env_tokens += len(reply)
                still.append(i)
            live = still
        stats.num_generated_tokens = sum(sum(m) for m in mask)
        stats.wall_time_s = time.perf_counter() - start_time
        groups = Groups(prompts, [torch.tensor(x, dtype=torch.long) for x in ids], [num_samples] * len(prompts),
                        finish_reasons=finish, sampler_logps=[torch.zeros(len(x)) for x in ids],
                        model_mask=[torch.tensor(m, dtype=torch.bool) for m in mask])
        return MultiTurnRollout(groups, stats, turns, [None] * n, list(handlers))

    return generate_multiturn


class RolloutSide:
    """One call = one rollout of the step's K x G conversations (a fixed batch of prompts, a fresh seed)."""

    def __init__(self, run, examples, baseline: bool):
        self.run, self.examples, self.baseline = run, examples, baseline
        self.log = TurnLog()
        self.results: list[dict] = []
        self.calls = 0

    def __call__(self) -> None:
        original = episode_module.generate_multiturn
        if self.baseline:
            episode_module.generate_multiturn = hf_reprefill_multiturn(self.log)
        try:
            start_time = time.perf_counter()
            episodes = self.run.episodes.sample(self.run.policy, self.run.tokenizer, self.examples,
                                                num_samples=self.run.num_generations, sampling=self.run.sampling,
                                                seed=1000 + self.calls, schedule=self.run.decode_schedule)
        finally:
            episode_module.generate_multiturn = original
        self.calls += 1
        stats = episodes.rollout.stats
        rewards = [episode.reward() or 0.0 for episode in episodes.episodes]
        self.results.append({"seconds": time.perf_counter() - start_time, "turns": stats.num_turns,
                             "model_tokens": stats.num_generated_tokens, "env_tokens": stats.num_env_tokens,
                             "forwards": stats.num_forwards, "accuracy": sum(rewards) / len(rewards),
                             **{k: v for k, v in episodes.metrics.items() if k in ("env/tool_calls", "env/template_drift")}})


def bench_rollout(repeats: int, warmup: int, num_prompts: int, num_generations: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run, config = calculator_run(Path(tmp), num_prompts, num_generations)
        examples = next(run.batches)
        run.policy.eval()
        sides = {"hf_generate_reprefill": RolloutSide(run, examples, baseline=True),
                 "turbogrpo": RolloutSide(run, examples, baseline=False)}
        timings = interleaved_medians(sides, repeats=repeats, warmup=warmup)
    ours, base = sides["turbogrpo"].results[warmup:], sides["hf_generate_reprefill"].results[warmup:]
    base_turns = sides["hf_generate_reprefill"].log.turns
    prompt_ids = statistics.mean(e.token_ids.numel() for e in examples)

    def per_turn_env_cost(results: list[dict]) -> float:
        return statistics.mean(r["env_tokens"] / max(r["turns"], 1) for r in results)

    record = {
        "shape": {"num_prompts": num_prompts, "num_generations": num_generations, "mean_prompt_ids": prompt_ids,
                  "temperature": config.rollout.temperature, "max_turns": config.env.max_turns,
                  "max_turn_tokens": config.env.max_turn_tokens,
                  "max_conversation_tokens": config.env.max_conversation_tokens, "dtype": config.model.dtype},
        "warmup": warmup, "repeats": repeats, "timings": timings,
        "speedup": timings["hf_generate_reprefill"]["median_s"] / timings["turbogrpo"]["median_s"],
        "runs": {"turbogrpo": ours, "hf_generate_reprefill": base},
        # What each engine prefills after the first turn: ours the environment's reply ids only (the
        # conversation's earlier ids stay in its cache), the baseline every live conversation from its first id.
        "prefilled_ids_per_later_turn": {
            "turbogrpo_env_reply_ids": per_turn_env_cost(ours),
            "hf_generate_reprefill_conversation_ids": statistics.mean(
                t["prefilled_ids"] / t["live"] for t in base_turns if t is not base_turns[0]) if len(base_turns) > 1 else None},
        "baseline_turns": base_turns,
    }
    return record


# --- the step: turbogrpo's loop against TRL's GRPOTrainer with environment_factory --------------------------


class CalculatorTool:
    """The calculator as TRL's ``environment_factory`` expects it: ``reset(**row)`` and one public tool
    (TRL exposes every public method as a tool, so ``Calculator.reply``, our feedback hook, stays out)."""

    def __init__(self):
        self._calculator = Calculator()

    def reset(self, **row) -> None:
        self._calculator.reset(**row)

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: Numbers joined by +, -, *, / and parentheses, for example "(12 + 7) * 3".
        """
        return self._calculator.calculate(expression)


def calculator_accuracy(prompts, completions, answer, **kwargs) -> list[float]:
    """TRL's reward: the last integer of the final assistant message against the row's answer."""
    scores = []
    for messages, gold in zip(completions, answer):
        final = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        scores.append(float(last_integer(final) == int(gold)))
    return scores


def pythonic_tokenizer(tokenizer):
    """SmolLM2's tokenizer with the tools template and a ``parse_response`` that reads pythonic calls, the way
    TRL parses a turn (the argument names come from the tool's signature, as ours binds them)."""
    tokenizer.chat_template = CHAT_TEMPLATES["smollm2_tools"]
    tools = {"calculate": CalculatorTool().calculate}
    tokenizer.response_schema = {"parser": "turbogrpo.env.tool_calls.parse_pythonic"}  # TRL only checks it is set

    def parse_response(ids, **_):
        text = tokenizer.decode(ids, skip_special_tokens=False).removesuffix(tokenizer.eos_token)
        content, calls = parse_pythonic(text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [bind_positional(tools, call).as_message_call() for call in calls]
        return message

    tokenizer.parse_response = parse_response
    return tokenizer


class TrlToolStepper(TrlStepper):
    """``e2e.TrlStepper`` (TRL's own loop in a thread, released one optimizer step at a time) with the tool."""

    def __init__(self, shape: dict, workdir: Path, num_steps: int, max_turns: int, config_overrides: dict | None = None):
        import trl.trainer.grpo_trainer as grpo_trainer
        from transformers import AutoTokenizer

        from turbogrpo.models import declared_tokenizer
        grpo_trainer.supports_tool_calling = lambda processing_class: True  # see the module docstring
        super().__init__(shape, workdir, num_steps,
                         tokenizer=pythonic_tokenizer(declared_tokenizer(
                             Path(shape["model"]), AutoTokenizer.from_pretrained(shape["model"]))),
                         trainer_kwargs={"environment_factory": CalculatorTool},
                         config_overrides={"max_tool_calling_iterations": max_turns - 1, **(config_overrides or {})})


def bench_step(repeats: int, warmup: int, num_prompts: int, num_generations: int, *,
               trl_overrides: dict | None = None, turbo_overrides: tuple[str, ...] = ()) -> dict:
    """The whole step, both trainers interleaved. ``trl_overrides`` (``GRPOConfig`` fields) and ``turbo_overrides``
    (config settings) adapt the two sides (bench/trl_vllm.py: TRL sampling with vLLM)."""
    from real_model import real_model_folder
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        run, config = calculator_run(workdir, num_prompts, num_generations, turbo_overrides)
        ours = OursStepper(run)
        shape = {"name": "SmolLM2-135M calculator tool", "model": real_model_folder(),
                 "rows": calculator_records("train", num_prompts * (warmup + repeats + 1), seed=1),
                 "reward": calculator_accuracy, "num_prompts": num_prompts, "num_generations": num_generations,
                 "max_new_tokens": config.env.max_conversation_tokens, "temperature": config.rollout.temperature,
                 "trl_micro_batch": num_generations}
        trl = TrlToolStepper(shape, workdir, warmup + repeats, config.env.max_turns, trl_overrides)
        memory = {"trl": StepMemory(trl), "turbogrpo": StepMemory(ours)}
        timings = interleaved_medians(memory, repeats=repeats, warmup=warmup)
        trl.thread.join(timeout=60)
    phases = ("rollout", "rewards", "logprobs", "update")
    ours_records = ours.records[warmup:]
    return {
        "shape": {"num_prompts": num_prompts, "num_generations": num_generations, "dtype": config.model.dtype,
                  "temperature": config.rollout.temperature, "max_turns": config.env.max_turns,
                  "max_conversation_tokens": config.env.max_conversation_tokens,
                  "trl_micro_batch": shape["trl_micro_batch"], "turbogrpo_micro_batch_tokens": config.train.micro_batch_tokens},
        "warmup": warmup, "repeats": repeats, "timings": timings,
        "speedup": timings["trl"]["median_s"] / timings["turbogrpo"]["median_s"],
        "phases_s": {"turbogrpo": {p: statistics.median(r.get(f"time/{p}", 0.0) for r in ours_records) for p in phases},
                     "trl": TrlStepper.median_phases(trl.records[warmup:])},
        "turbogrpo_env": {k: statistics.mean(r[k] for r in ours_records) for k in ours_records[0] if k.startswith("env/")},
        "turbogrpo_completion_length": statistics.mean(r["completion_length/mean"] for r in ours_records),
        "settings": {"loss": config.algo.loss, "beta": config.algo.beta, "lr": config.optim.lr,
                     "max_grad_norm": config.optim.max_grad_norm},
    }


class OursStepper:
    """One call = one ``grpo_step`` of turbogrpo's loop on the calculator run."""

    def __init__(self, run):
        self.run, self.step, self.records = run, 0, []

    def __call__(self) -> None:
        self.records.append(loop.grpo_step(self.run, self.step))
        self.step += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="rollout,step", help="comma-separated: rollout, step")
    parser.add_argument("--prompts", type=int, default=8, help="K prompts per rollout/step")
    parser.add_argument("--generations", type=int, default=8, help="G conversations per prompt")
    parser.add_argument("--quick", action="store_true", help="1 timed run each, no warm-up")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--name", default="multiturn_smollm2_calculator", help="bench/results/<name>.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    payload = {"load_average_before": os.getloadavg()}
    parts = args.parts.split(",")
    if "rollout" in parts:
        record = bench_rollout(1 if args.quick else 3, 0 if args.quick else 1, args.prompts, args.generations)
        payload["rollout"] = record
        t = record["timings"]
        print_table("multi-turn rollout (s)", ["engine", "median", "min", "turns", "env ids/turn"],
                    [[name, t[name]["median_s"], t[name]["min_s"],
                      statistics.mean(r["turns"] for r in record["runs"][name]),
                      statistics.mean(r["env_tokens"] / max(r["turns"], 1) for r in record["runs"][name])]
                     for name in t])
        print(f"speedup {record['speedup']:.2f}x; prefilled ids per later turn: {record['prefilled_ids_per_later_turn']}")
    if "step" in parts:
        record = bench_step(1 if args.quick else 2, 0 if args.quick else 1, args.prompts, args.generations)
        payload["step"] = record
        t = record["timings"]
        print_table("multi-turn GRPO step (s)", ["trainer", "median", "min", *record["phases_s"]["trl"]],
                    [[name, t[name]["median_s"], t[name]["min_s"], *record["phases_s"][name].values()] for name in t])
        print(f"speedup {record['speedup']:.2f}x")
    payload["load_average"] = os.getloadavg()
    write_results(args.name + ("_quick" if args.quick else ""), payload)


if __name__ == "__main__":
    main()
