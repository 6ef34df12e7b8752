"""Base rates of the built-in multi-turn tasks for SmolLM2-135M-Instruct, before any training.

GRPO needs groups that mix solved and unsolved conversations, so a task it can learn on starts between
about 10% and 60% sampled success. Each task runs as its shipped config does (configs/smollm2_calculator.toml,
configs/smollm2_guess_number.toml: environment, chat template, tool parser, turn limits) on held-out rows,
greedy and sampled (4 per problem) at the configs' temperature 0.7. The calculator is also asked without
its tool (the question alone, answered in the model's head, as scripts/smollm2_task_rates.py asks its
candidates) to show that the tool is needed. Writes bench/results/smollm2_tool_task_rates.json.

    python scripts/smollm2_tool_task_rates.py [--num 48]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from harness import write_results  # noqa: E402

from turbogrpo.config import load_config  # noqa: E402
from turbogrpo.data.tool_tasks import calculator_records, guess_number_records  # noqa: E402
from turbogrpo.env import TurnLimits, run_episodes  # noqa: E402
from turbogrpo.env.tasks import CHAT_TEMPLATES, last_integer  # noqa: E402
from turbogrpo.models import load_model_and_tokenizer  # noqa: E402
from turbogrpo.rollout import SamplingConfig, generate  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TASKS = {"calculator": (CONFIGS / "smollm2_calculator.toml", calculator_records),
         "guess_number": (CONFIGS / "smollm2_guess_number.toml", guess_number_records)}
SETTINGS = ((0.0, 1), (0.7, 4))  # (temperature, samples per problem)


def episode_rate(model, tokenizer, config_path: Path, rows: list[dict], temperature: float, num_samples: int) -> dict:
    env = load_config(config_path).env
    out = run_episodes(model, tokenizer, rows, [row["prompt"] for row in rows], env.factory, num_samples=num_samples,
                       sampling=SamplingConfig(max_new_tokens=env.max_conversation_tokens, temperature=temperature),
                       max_turns=env.max_turns, limits=TurnLimits(env.max_turn_tokens, env.max_conversation_tokens),
                       tool_parser=env.tool_parser, end_of_turn=env.end_of_turn,
                       chat_template=CHAT_TEMPLATES.get(env.chat_template, env.chat_template), seed=0,
                       reply_timing="next_step")
    rewards = [episode.reward() or 0.0 for episode in out.episodes]
    return {"success": sum(rewards) / len(rewards), "num_scored": len(rewards),
            **{key: round(value, 4) for key, value in out.metrics.items()}}


def in_head_rate(model, tokenizer, rows: list[dict], temperature: float, num_samples: int) -> dict:
    """The calculator's questions without the tool: the system prompt's rule and the question alone."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompts = [torch.tensor(tokenizer(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{row['prompt'][-1]['content']} Reply with only the number."}],
        tokenize=False, add_generation_prompt=True), add_special_tokens=False).input_ids) for row in rows]
    rollout = generate(model, prompts, num_samples=num_samples, seed=0,
                       sampling=SamplingConfig(max_new_tokens=32, temperature=temperature, stop_token_ids=(end,)))
    scores = [float(last_integer(tokenizer.decode(c, skip_special_tokens=True)) == int(row["answer"]))
              for row, group in zip(rows, rollout.tokens_per_group()) for c in group]
    return {"success": sum(scores) / len(scores), "num_scored": len(scores)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num", type=int, default=48, help="held-out problems per task")
    args = parser.parse_args()
    model, tokenizer = load_model_and_tokenizer("smollm2-135m-instruct")
    model.eval()
    results = {}
    candidates = {name: (lambda t, n, path=path, make=make: episode_rate(model, tokenizer, path, make("eval", args.num), t, n))
                  for name, (path, make) in TASKS.items()}
    candidates["calculator without the tool"] = (
        lambda t, n: in_head_rate(model, tokenizer, calculator_records("eval", args.num), t, n))
    for name, measure in candidates.items():
        results[name] = {}
        for temperature, num_samples in SETTINGS:
            start = time.perf_counter()
            results[name][f"temperature_{temperature}"] = rate = measure(temperature, num_samples)
            print(f"{name:30s} T={temperature}: {rate['success']:6.1%} of {rate['num_scored']} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    write_results("smollm2_tool_task_rates", {
        "model": "smollm2-135m-instruct", "problems_per_task": args.num,
        "settings": [{"temperature": t, "samples_per_problem": n} for t, n in SETTINGS],
        "configs": {name: str(path.relative_to(CONFIGS.parent)) for name, (path, _) in TASKS.items()},
        "tasks": results})


if __name__ == "__main__":
    main()
