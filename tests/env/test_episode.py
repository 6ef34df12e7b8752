"""Episodes on the shipped demo model: environments answer its turns, replies are masked, failures stay
with their conversation, and the recorded ids are checked against the chat template."""

import math
import warnings

import pytest
import torch

from turbogrpo.data.arithmetic import demo_records
from turbogrpo.env import ChatRenderer, Episode, environment_tools, tool_schemas, TurnLimits, environment_reward, get_tool_call_parser, run_episodes
from turbogrpo.env import episode as episode_module
from turbogrpo.env.tasks import DEMO_CHAT_TEMPLATE, Calculator, RetryArithmetic
from turbogrpo.models import load_demo_model
from turbogrpo.rewards import Reward, compute_rewards
from turbogrpo.rollout import SamplingConfig

SAMPLING = SamplingConfig(max_new_tokens=24)
LIMITS = TurnLimits(max_turn_tokens=24, max_conversation_tokens=120)


@pytest.fixture(scope="module")
def demo():
    torch.set_num_threads(1)
    return load_demo_model()


def rows_and_messages(num: int):
    records = demo_records("train", num, seed=3)
    messages = [[{"role": "user", "content": r["prompt"].removesuffix("\nAnswer:")}] for r in records]
    return [{"answer": r["answer"]} for r in records], messages


def episodes(demo, factory, num_rows=2, num_samples=2, max_turns=3, template=DEMO_CHAT_TEMPLATE, seed=0, **options):
    model, tokenizer = demo
    rows, messages = rows_and_messages(num_rows)
    return run_episodes(model, tokenizer, rows, messages, factory, num_samples=num_samples, sampling=SAMPLING,
                        max_turns=max_turns, limits=LIMITS, chat_template=template, seed=seed, **options)


def test_feedback_episodes_mask_the_replies_and_score_each_conversation(demo):
    model, tokenizer = demo
    result = episodes(demo, RetryArithmetic, seed=1)
    groups = result.rollout.groups
    assert result.prompt_texts[0].endswith("\nAnswer:") and result.metrics["env/template_drift"] == 0.0
    assert result.metrics["env/env_tokens"] > 0
    for i, (ids, mask, episode) in enumerate(zip(groups.completions, groups.model_mask, result.episodes)):
        env_text = tokenizer.decode(ids[~mask])
        replies = [m for m in episode.messages if m["role"] == "user"][1:]
        assert env_text == "\nWrong. Try again.\nAnswer:" * len(replies)
        # The engine also counts a last turn cut by a limit, which never reaches the environment.
        assert episode.num_turns <= result.rollout.num_turns[i] <= min(episode.num_turns + 1, 3)
        with torch.no_grad():  # the sampler's log-probs of model tokens: a plain forward of the conversation
            prompt = groups.prompts[i // 2]
            logits = model(torch.cat([prompt, ids])[None]).logits[0, len(prompt) - 1:-1]
        reference = logits.log_softmax(-1).gather(-1, ids[:, None])[:, 0]
        torch.testing.assert_close(groups.sampler_logps[i][mask], reference[mask], rtol=1e-4, atol=1e-4)  # float32, 8 layers
    rewards = compute_rewards([Reward("env", environment_reward)], ["p"] * 4, ["c"] * 4,
                              {"environments": result.episodes})
    assert rewards.total.tolist() == [float(e.env.solved) for e in result.episodes]


class Endless(RetryArithmetic):
    def reply(self, message):
        return "Again."


def test_a_never_ending_environment_is_capped_by_max_turns(demo):
    result = episodes(demo, Endless, num_rows=1, max_turns=2)
    for i, episode in enumerate(result.episodes):
        assert episode.num_turns <= 2
        if result.rollout.groups.finish_reasons[i] == "stop":
            assert episode.num_turns == 2 and episode.hit_max_turns
    assert result.metrics["env/max_turns_hit"] > 0


class Numbered(RetryArithmetic):
    """A RetryArithmetic that knows its place (1, 2, ...) among the instances its class made."""
    made = 0

    def __init__(self):
        super().__init__()
        type(self).made += 1
        self.number = type(self).made


class FlakyReset(Numbered):
    def reset(self, **row):
        if self.number == 2:
            raise RuntimeError("no sandbox")
        if self.number == 3:
            return 42
        return super().reset(**row)


def test_failing_resets_fail_their_conversation_only(demo):
    FlakyReset.made = 0
    result = episodes(demo, FlakyReset, num_rows=2, max_turns=2)
    errors = [e.error for e in result.episodes]
    assert errors == [None, "reset() raised RuntimeError: no sandbox", "reset() returned a int, not a str or None",
                      None]
    assert result.metrics["env/failures"] == 0.5
    assert [e.num_turns for e in result.episodes][1:3] == [1, 1]  # the failed ones stop at their first turn end
    assert result.episodes[1].reward() is None


class Rewards(RetryArithmetic):
    values = iter(())

    def get_reward(self):
        value = next(Rewards.values)
        if isinstance(value, Exception):
            raise value
        return value


def test_env_rewards_that_are_not_numbers_are_per_item_failures(demo):
    Rewards.values = iter([1.0, math.nan, "high", ValueError("judge down")])
    result = episodes(demo, Rewards, num_rows=2, max_turns=1)
    rewards = compute_rewards([Reward("env", environment_reward)], ["p"] * 4, ["c"] * 4,
                              {"environments": result.episodes})
    assert rewards.failed["env"].tolist() == [False, True, True, True] and rewards.num_failed["env"] == 3
    assert rewards.total.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_recorded_ids_win_over_a_template_that_renders_them_differently(demo, monkeypatch):
    monkeypatch.setattr(episode_module, "_DRIFT_WARNED", False)
    stripping = DEMO_CHAT_TEMPLATE.replace("'assistant' -%}{{ message.content }}", "'assistant' -%}{{ message.content | trim }}")
    assert stripping != DEMO_CHAT_TEMPLATE
    with pytest.warns(UserWarning, match="training uses the recorded ids"):
        result = episodes(demo, RetryArithmetic, num_rows=1, max_turns=1, template=stripping)
    assert result.metrics["env/template_drift"] > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        episodes(demo, RetryArithmetic, num_rows=1, max_turns=1, template=stripping)


def tool_episode(tokenizer, env):
    """An Episode of ``env``'s tools (hermes calls, the demo template), its renderer, and ``turn(text)``: the
    episode's answer (reply ids or None) to a model turn of ``text``."""
    tools = environment_tools(env)
    renderer = ChatRenderer(tokenizer, tool_schemas(tools), "<|endoftext|>", DEMO_CHAT_TEMPLATE)
    episode = Episode(env, tools, renderer, get_tool_call_parser("hermes"),
                      lambda ids: tokenizer.decode(ids, skip_special_tokens=False), max_turns=4)

    def turn(text):
        return episode(tokenizer(text + "<|endoftext|>", add_special_tokens=False)["input_ids"])
    return episode, renderer, turn


def test_tool_calls_are_run_and_their_replies_rendered(demo):
    _, tokenizer = demo
    env = Calculator()
    episode, renderer, turn = tool_episode(tokenizer, env)

    reply = turn(' <tool_call>{"name": "calculate", "arguments": {"expression": "19 * 3"}}</tool_call>')
    assert tokenizer.decode(reply) == "\nResult: 57\nAnswer:"
    assert tokenizer.decode(turn('<tool_call>{"name": "calc", "arguments": {}}</tool_call>')) == \
        "\nResult: {'error': \"Tool calc not found. Available tools: ['calculate']\"}\nAnswer:"
    assert "not valid JSON" in tokenizer.decode(turn("<tool_call>{oops</tool_call>"))
    assert episode.num_tool_calls == 3 and episode.num_tool_failures == 2
    env.reset(answer=57)
    assert turn(" #### 57") is None and env.get_reward() == 1.0  # no tool call: the answer ends the episode
    assert renderer.render(episode.messages[:0] + [{"role": "user", "content": "q"}]).startswith("Tools: calculate")


class FlakyReply(Numbered):
    """Conversation 2's reply() raises, conversation 3's returns a number; the others play RetryArithmetic."""

    def reply(self, message):
        if self.number == 2:
            raise ConnectionError("judge unreachable")
        if self.number == 3:
            return 7
        return super().reply(message)


def test_failing_replies_fail_their_conversation_only(demo):
    """reply() that raises or returns a non-string: that conversation stops with its error recorded (its turn
    kept, its reward None, a failed item), the others are played on as without it."""
    FlakyReply.made = 0
    result = episodes(demo, FlakyReply, num_rows=2, max_turns=3, seed=1)
    FlakyReply.made = 4   # every instance plain RetryArithmetic: the same seed, the same first turns
    plain = episodes(demo, FlakyReply, num_rows=2, max_turns=3, seed=1)
    errors = [e.error for e in result.episodes]
    assert errors == [None, "reply() raised ConnectionError: judge unreachable",
                      "reply() returned a int, not a str or None", None]
    assert result.metrics["env/failures"] == 0.5
    assert [result.episodes[i].reward() for i in (1, 2)] == [None, None]
    groups, plain_groups = result.rollout.groups, plain.rollout.groups
    for i in (1, 2):   # the failed ones keep their first turn (all model tokens), and stop there
        assert result.episodes[i].num_turns == 1 and groups.model_mask[i].all()
        first_turn = plain_groups.completions[i][:len(groups.completions[i])]
        assert torch.equal(groups.completions[i], first_turn)
    rewards = compute_rewards([Reward("env", environment_reward)], ["p"] * 4, ["c"] * 4,
                              {"environments": result.episodes})
    assert rewards.failed["env"].tolist() == [False, True, True, False]
    assert rewards.total[[0, 3]].tolist() == [float(result.episodes[i].env.solved) for i in (0, 3)]


class BrokenCalculator(Calculator):
    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: Numbers joined by +, -, *, / and parentheses, for example "(12 + 7) * 3".
        """
        if "9" in expression:
            raise TimeoutError("sandbox timed out")
        return super().calculate(expression)


def test_a_raising_tool_or_wrong_arguments_are_the_models_tool_reply_and_the_episode_goes_on(demo):
    _, tokenizer = demo
    env = BrokenCalculator()
    episode, renderer, turn = tool_episode(tokenizer, env)

    call = '<tool_call>{"name": "calculate", "arguments": %s}</tool_call>'
    assert tokenizer.decode(turn(call % '{"expression": "19 * 3"}')) == \
        "\nResult: {'error': 'TimeoutError: sandbox timed out'}\nAnswer:"
    wrong = tokenizer.decode(turn(call % '{"expr": "2 * 3"}'))
    assert wrong.startswith("\nResult: {'error': \"TypeError: ") and "'expr'" in wrong
    assert tokenizer.decode(turn(call % '{"expression": "2 * 3"}')) == "\nResult: 6\nAnswer:"  # still playing
    assert episode.error is None and episode.num_tool_calls == 3 and episode.num_tool_failures == 2
    env.reset(answer=6)
    assert turn(" #### 6") is None and env.get_reward() == 1.0


def test_templates_without_tool_support_are_refused(demo):
    _, tokenizer = demo
    no_tools = "{% for message in messages %}{{ message.content }}<|endoftext|>{% endfor %}"
    schema = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]
    with pytest.raises(ValueError, match="the chat template ignores tools="):
        ChatRenderer(tokenizer, schema, "<|endoftext|>", no_tools)
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        ChatRenderer(tokenizer, None, "<|endoftext|>", None)


def test_a_group_needs_one_observation(demo):
    class Random(RetryArithmetic):
        count = 0

        def reset(self, **row):
            Random.count += 1
            return f" ({Random.count})"
    with pytest.raises(ValueError, match="different observations for the 2 conversations of row 0"):
        episodes(demo, Random, num_rows=1)


class Noted(RetryArithmetic):
    """A feedback environment with state that a fork must copy, not share."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def reply(self, message):
        self.seen.append(message)
        return super().reply(message)


def test_branching_episodes_share_their_first_turn_and_fork_their_environments(demo):
    model, tokenizer = demo
    result = episodes(demo, Noted, num_rows=2, num_samples=4, seed=0, reply_timing="next_step", branching=[2, 2])
    forks = result.episodes
    assert len(forks) == 8 and len({id(e.env) for e in forks}) == 8
    assert len({id(e.messages) for e in forks}) == 8
    forked = 0
    for left, right in zip(forks[0::2], forks[1::2]):
        if max(left.num_turns, right.num_turns) >= 2:  # the first reply was taken: they forked after it
            assert left.messages[:3] == right.messages[:3] and left.env.seen[0] == right.env.seen[0]
            forked += 1
        before = list(left.env.seen)
        right.env.seen.append("later")
        assert left.env.seen == before
    assert forked >= 1  # the case under test happened
    assert result.metrics["env/template_drift"] == 0.0  # each episode's history renders to its own ids
    for i, episode in enumerate(forks):
        text = tokenizer.decode(result.rollout.groups.completions[i])
        assert text.count("Wrong. Try again.") == sum(m["content"] == "Wrong. Try again." for m in episode.messages)


class Unforkable(RetryArithmetic):
    def __deepcopy__(self, memo):
        raise TypeError("holds a socket")


def test_an_environment_that_cannot_fork_is_refused_before_the_rollout(demo, monkeypatch):
    from turbogrpo.rollout import multiturn

    def no_rollout(*args, **kwargs):
        raise AssertionError("the rollout ran")

    monkeypatch.setattr(multiturn, "_run", no_rollout)
    with pytest.raises(ValueError, match=r"environment, but Unforkable cannot be forked \(TypeError: holds a socket\)"):
        episodes(demo, Unforkable, num_rows=1, num_samples=4, branching=[2, 2])
    with pytest.raises(ValueError, match="branching"):
        episodes(demo, RetryArithmetic, num_rows=1, num_samples=4, branching=[3])
