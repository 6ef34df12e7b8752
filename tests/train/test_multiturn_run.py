"""`turbogrpo train` with an [env] section, end to end on the shipped demo model (configs/demo_multiturn.toml,
cut to a few small steps): each step trains on conversations, environment ids never reach the loss, a
resumed run equals an uninterrupted one, speculative rollouts decode the conversations, and [env] with online
draft learning is refused in one line."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from turbogrpo.config import ConfigError, load_config
from turbogrpo.train import loop
from turbogrpo.train.metrics import read_metrics
from turbogrpo.train.state import TrainingInterrupted

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "demo_multiturn.toml"


def small(output_dir: Path, **extra) -> list[str]:
    """Overrides cutting the shipped multi-turn config to 2 prompts x 4 conversations per step."""
    sets = {"train.num_steps": 2, "train.prompts_per_step": 2, "rollout.num_generations": 4,
            "data.num_train_problems": 16, "data.num_eval_problems": 4, "data.num_eval_samples": 1,
            "env.max_conversation_tokens": 96, "train.output_dir": f'"{output_dir}"', "train.checkpoint_every": 0,
            "log.progress_bar": "false", "log.tensorboard": "false", "log.report": "false", "log.completions_every": 1,
            **extra}
    return [f"{k}={v}" for k, v in sets.items()]


def comparable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/") and "per_s" not in k} for r in records]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(max(run_dir.glob("step-*")) / "model.safetensors")


def interrupted_at(stop: int, config, monkeypatch) -> None:
    """Train ``config`` until Ctrl-C arrives at the start of step ``stop`` (steps done before it)."""
    grpo_step = loop.grpo_step

    def interrupted(run, step):
        if step == stop:
            raise KeyboardInterrupt
        return grpo_step(run, step)
    with monkeypatch.context() as patched:
        patched.setattr(loop, "grpo_step", interrupted)
        with pytest.raises(TrainingInterrupted):
            loop.train(config)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the config's train.num_threads = 1 holds for the rest of the session


def test_a_multiturn_run_trains_on_conversations_and_logs_env_metrics(tmp_path):
    summary = loop.train(load_config(CONFIG, small(tmp_path / "run")))
    steps = [r for r in read_metrics(tmp_path / "run") if "reward" in r]
    assert summary.steps == 2 and len(steps) == 2 and [e["step"] for e in summary.evals] == [0, 2]
    for record in steps:
        assert record["env/env_tokens"] > 0 and 1 <= record["env/turns"] <= 3  # retries were prefilled
        assert record["env/failures"] == 0 and record["env/template_drift"] == 0
        assert record["rewards/environment/mean"] == record["reward"] and record["accuracy"] == record["reward"]
        # Over the model's tokens only: environment ids have sampler log-prob 0, far from the trainer's.
        assert record["logprob_gap"] < 1e-4
    completions = [line for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert any("Wrong. Try again." in line for line in completions)


class SpoiledEnvTokens(nn.Module):
    """The trainer (or reference) with garbage log-probs and entropies on the environment ids of the
    micro-batches it is given, in the order it runs them."""

    def __init__(self, module: nn.Module, micro_batches):
        super().__init__()
        self.module, self.masks = module, [torch.cat(mb.model_mask) for mb in micro_batches]
        self.generator = torch.Generator().manual_seed(len(self.masks))

    def forward(self, prompts, completions, **options):
        result = self.module(prompts, completions, **options)
        model_tokens = self.masks.pop(0).to(result.logps.device)
        assert not model_tokens.all() and model_tokens.numel() == result.logps.numel()

        def spoil(values):
            if values is None:
                return None
            garbage = torch.rand(values.shape, generator=self.generator, dtype=values.dtype) * 6 - 3
            return torch.where(model_tokens, values, garbage.to(values.device))
        return result._replace(logps=spoil(result.logps), entropy=spoil(result.entropy))


def test_environment_tokens_never_reach_the_loss(tmp_path, monkeypatch):
    """A run whose policy, old-policy and reference log-probs (and entropies) are garbage on every environment
    id gives the same losses, KL, entropy and final weights, bit for bit; with KL and TIS on."""
    extra = {"algo.beta": 0.04, "algo.tis_cap": 2.0, "algo.num_iterations": 2, "train.checkpoint_every": 2}
    loop.train(load_config(CONFIG, small(tmp_path / "plain", **extra)))
    update_policy, score = loop.update_policy, loop.logprobs_of
    monkeypatch.setattr(loop, "update_policy", lambda module, mbs, *args, **kw: update_policy(
        SpoiledEnvTokens(module, mbs), mbs, *args, **kw))
    monkeypatch.setattr(loop, "logprobs_of", lambda module, mbs, name: score(SpoiledEnvTokens(module, mbs), mbs, name))
    loop.train(load_config(CONFIG, small(tmp_path / "spoiled", **extra)))
    plain, spoiled = (comparable(read_metrics(tmp_path / d)) for d in ("plain", "spoiled"))
    assert plain == spoiled and all("kl" in r for r in plain if "reward" in r)
    weights_plain, weights_spoiled = final_weights(tmp_path / "plain"), final_weights(tmp_path / "spoiled")
    assert all(torch.equal(weights_plain[k], weights_spoiled[k]) for k in weights_plain)


def test_an_interrupted_multiturn_run_resumes_to_the_uninterrupted_one(tmp_path, monkeypatch):
    extra = {"train.num_steps": 4, "train.checkpoint_every": 2, "optim.schedule": "cosine"}
    loop.train(load_config(CONFIG, small(tmp_path / "straight", **extra)))
    interrupted_at(3, load_config(CONFIG, small(tmp_path / "resumed", **extra)), monkeypatch)
    loop.train(load_config(CONFIG, small(tmp_path / "resumed", **extra)), resume=True)
    straight, resumed = (comparable(read_metrics(tmp_path / d)) for d in ("straight", "resumed"))
    assert [r["step"] for r in resumed] == [r["step"] for r in straight]
    for a, b in zip(resumed, straight):
        assert a == b, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    weights_straight, weights_resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed")
    assert all(torch.equal(weights_straight[k], weights_resumed[k]) for k in weights_straight)


def test_a_speculative_multiturn_run_trains_on_the_same_kind_of_conversations(tmp_path):
    """rollout.speculation with history drafts and a frozen draft: the conversations are decoded speculatively
    (spec/* metrics), replies are prefilled and masked, and the sampler's log-probs are the trainer's."""
    extra = {"rollout.speculation": '"fixed"', "draft.history": "true", "draft.learn": "false", "train.num_steps": 1}
    loop.train(load_config(CONFIG, small(tmp_path / "run", **extra)))
    steps = [r for r in read_metrics(tmp_path / "run") if "reward" in r]
    assert len(steps) == 1
    record = steps[0]
    assert record["spec/accepted_length"] >= 1.0 and record["spec/draft_forwards"] > 0
    assert record["env/env_tokens"] > 0 and record["env/failures"] == 0
    assert record["logprob_gap"] < 1e-4


def test_env_with_online_draft_learning_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="config key 'draft.learn': True is not allowed; expected false with an "
                                          "\\[env\\] factory and rollout.speculation on"):
        load_config(CONFIG, small(tmp_path / "x", **{"rollout.speculation": '"cost"'}))
    with pytest.raises(ConfigError, match="config key 'data.chat_template': 'never'"):
        load_config(CONFIG, small(tmp_path / "x", **{"data.chat_template": '"never"'}))
    cli = subprocess.run([sys.executable, "-m", "turbogrpo", "train", str(CONFIG), "--set",
                          'rollout.speculation="cost"'], cwd=REPO, capture_output=True, text=True,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert cli.returncode != 0 and cli.stdout == ""
    assert cli.stderr.strip().count("\n") == 0 and "'draft.learn'" in cli.stderr, cli.stderr


def test_held_out_accuracy_with_an_env_is_the_share_of_solved_conversations():
    from turbogrpo.config import DataConfig, EnvConfig
    from turbogrpo.data.prompt_sets import load_eval_prompts
    from turbogrpo.models import load_demo_model
    from turbogrpo.rewards import Reward, resolve_reward
    from turbogrpo.rollout import SamplingConfig
    from turbogrpo.placement import DistInfo
    from turbogrpo.train.episodes import build_episode_sampler
    from turbogrpo.train.evaluate import evaluate_accuracy

    model, tokenizer = load_demo_model()
    sampler = build_episode_sampler(EnvConfig(factory="turbogrpo.env.tasks:RetryArithmetic", chat_template="demo",
                                              tool_parser="none", max_turns=2, max_turn_tokens=32,
                                              max_conversation_tokens=80), tokenizer)
    examples = load_eval_prompts(DataConfig(kind="arithmetic_chat", num_eval_problems=6), tokenizer, max_new_tokens=80)
    assert examples[0].text.endswith("have now?\nAnswer:") and examples[0].messages[0]["role"] == "user"
    greedy = SamplingConfig(max_new_tokens=32, temperature=0.0, stop_token_ids=(tokenizer.eos_token_id,))
    measured = evaluate_accuracy(model, tokenizer, examples, Reward("environment", resolve_reward("environment"), 0.0),
                                 greedy, DistInfo(0, 1, 0, torch.device("cpu")), episodes=sampler)
    episodes = sampler.sample(model, tokenizer, examples, num_samples=1, sampling=greedy, seed=None).episodes
    solved = [e.env.solved for e in episodes]
    assert measured.num_scored == 6 and measured.accuracy == sum(solved) / 6
    assert any(e.num_turns == 2 for e in episodes)  # some answers took the second chance


def test_a_branching_run_trains_on_its_forked_conversations(tmp_path):
    """rollout.branching = [2, 2]: 2 first conversations per prompt, each forked 2 ways after its first reply;
    the G = 4 leaves train as conversations of their own (sampler log-probs still the trainer's)."""
    summary = loop.train(load_config(CONFIG, small(tmp_path / "run", **{"rollout.branching": "[2, 2]"})))
    steps = [r for r in read_metrics(tmp_path / "run") if "reward" in r]
    assert summary.steps == 2 and len(steps) == 2
    for record in steps:
        assert record["env/env_tokens"] > 0 and record["env/failures"] == 0 and record["env/template_drift"] == 0
        assert record["logprob_gap"] < 1e-4
    with pytest.raises(ConfigError, match=r"config key 'rollout.branching': \[2, 3\] is not allowed; expected \[\] or "
                                          "integers >= 1 whose product is num_generations=4"):
        load_config(CONFIG, small(tmp_path / "x", **{"rollout.branching": "[2, 3]"}))
    with pytest.raises(ConfigError, match="'rollout.branching'.*without an \\[env\\] factory"):
        load_config(CONFIG, small(tmp_path / "x", **{"rollout.branching": "[2, 2]", "env.factory": '""'}))
