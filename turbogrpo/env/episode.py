"""Episodes: one environment per conversation, answering the model's turns inside a multi-turn rollout.

``Episode`` is the engine's ``TurnHandler`` for one conversation: it reads the turn's text, runs the tool
calls it makes (or hands the text to the environment's ``reply``), and returns the ids of the answer as
the chat template renders it. ``run_episodes`` is the whole rollout: make and reset the environments,
render each group's prompt once, run ``rollout.multiturn.generate_multiturn``, then check each finished
conversation's recorded ids against the template's rendering of it (drift: warned once, counted; the
recorded ids are what is trained on).

Failures are per conversation (``Episode.error``, its text in the run's log and ``completions.jsonl``): a
``reset`` that raises or returns a non-string, a ``reply`` that does, an exception inside the handler, an
environment call past the time limit or one that raises ``SystemExit`` (``rollout.env_calls``: environment
code runs on daemon threads, at most ``max_workers`` at once), a ``get_reward`` that raises or returns no
finite number. A tool that raises, an unknown tool or malformed arguments are not failures: the model reads
the error as its tool reply (``environment.call_tool``).
"""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import nn

from turbogrpo.env.chat import ChatRenderer
from turbogrpo.env.environment import (EnvironmentFault, bind_positional, call_tool, check_environment, environment_reply,
                                       environment_reward_value, environment_tools, load_factory, reset_environment,
                                       tool_schemas)
from turbogrpo.env.tool_calls import ToolCallParser, get_tool_call_parser
from turbogrpo.rollout.decode import DecodeSchedule
from turbogrpo.rollout.env_calls import EnvCallFailed, EnvCalls
from turbogrpo.rollout.multiturn import MultiTurnRollout, TurnLimits, check_branching, fork_copy, generate_multiturn
from turbogrpo.reward_items import ItemFailure
from turbogrpo.rollout.sampling import SamplingConfig


@dataclass
class Episode:
    """One conversation's environment and what happened in it (a ``TurnHandler``)."""

    env: Any
    tools: dict[str, Callable]
    renderer: ChatRenderer
    parser: ToolCallParser
    decode: Callable[[list[int]], str]
    max_turns: int
    messages: list[dict] = field(default_factory=list)
    """The conversation as chat messages (prompt, then each turn and reply), for the drift check and logs."""
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_failures: int = 0
    hit_max_turns: bool = False
    error: str | None = None
    """Why this conversation failed (its reward is then a failure too), or None."""
    calls: EnvCalls | None = None
    """Runs ``get_reward`` (time-limited, exits caught); None: called directly."""
    calling: str = "the environment"
    """The environment method running now (or last), to name it when it runs past the time limit."""
    _reward: tuple | None = None
    """(value or None, error or None) once ``get_reward`` has been read."""

    def __call__(self, turn_ids: list[int]) -> list[int] | None:
        self.num_turns += 1
        text = self.decode(turn_ids[:-1])  # the last id is the end-of-turn token
        content, calls = self.parser(text) if self.tools else (text, [])
        calls = [bind_positional(self.tools, call) for call in calls]
        self.messages.append({"role": "assistant", "content": content,
                              **({"tool_calls": [c.as_message_call() for c in calls]} if calls else {})})
        if self.error is not None:
            return None
        # The environment sees every turn, the last one too (it may hold the answer it scores).
        reply = self._tool_replies(calls) if calls else self._feedback(text)
        if reply is None:
            return None
        if self.num_turns >= self.max_turns:  # an episode that would go on is cut here; the reply is unsent
            self.hit_max_turns = True
            return None
        self.messages.extend(reply)
        return self.renderer.reply_ids(reply, [c.as_message_call() for c in calls])

    @property
    def env_name(self) -> str:
        """The environment's class name, for messages."""
        return type(self.env).__name__

    def record(self) -> EpisodeRecord:
        """What the trainer needs of this episode where the environment cannot travel (a remote rollout worker):
        its ``get_reward()``, read here and now, the messages and the counters."""
        value = self.reward()
        return EpisodeRecord(self.env_name, copy.deepcopy(self.messages), self.num_turns, self.num_tool_calls,
                             self.num_tool_failures, self.hit_max_turns, self.error, value, self.reward_error)

    def fork(self) -> Episode:
        """A branch of this episode (rollout branching): the environment forked (its ``fork()``, else a deep
        copy), the message history and counters copied; renderer, parser and decoder shared (stateless)."""
        env = fork_copy(self.env, "environment")
        return replace(self, env=env, tools=environment_tools(env), messages=copy.deepcopy(self.messages))

    def _tool_replies(self, calls: list) -> list[dict]:
        replies = []
        for call in calls:
            self.calling = f"tool {call.name}()"
            result, failed = call_tool(self.tools, call)
            self.num_tool_calls += 1
            self.num_tool_failures += failed
            replies.append({"role": "tool", "name": call.name, "content": result})
        return replies

    def _feedback(self, text: str) -> list[dict] | None:
        """The environment's answer to a turn without tool calls as a user message, or None (episode over;
        a tool environment's episode ends on such a turn)."""
        if not callable(getattr(self.env, "reply", None)):
            return None
        self.calling = "reply()"
        try:
            answer = environment_reply(self.env, text)
        except EnvironmentFault as err:
            self.error = str(err)
            return None
        return None if answer is None else [{"role": "user", "content": answer}]

    def reward(self) -> float | None:
        """The environment's ``get_reward()`` as a float, None where it has none, failed or gave no finite
        number (``reward_error`` says why). Read once; later calls give the same."""
        if self._reward is None:
            self._reward = self._read_reward()
        return self._reward[0]

    @property
    def reward_error(self) -> str | None:
        """Why this conversation has no reward (its failure, or ``get_reward``'s), or None."""
        self.reward()
        return self._reward[1]

    @property
    def failure(self) -> str | None:
        """This conversation's failure, or its ``get_reward``'s where that has been read and failed (what a
        run's ``completions.jsonl`` keeps as ``env_error``)."""
        return self.error or (self._reward[1] if self._reward is not None else None)

    def _read_reward(self) -> tuple[float | None, str | None]:
        if self.error is not None:
            return None, self.error
        if not callable(getattr(self.env, "get_reward", None)):
            return None, "no get_reward() method"
        self.calling = "get_reward()"
        try:
            value = (self.calls.call if self.calls is not None else _direct)(environment_reward_value, self.env)
        except EnvironmentFault as err:
            return None, str(err)
        except EnvCallFailed as err:
            return None, f"get_reward() {err}"
        return value, None


@dataclass
class EpisodeRecord:
    """An ``Episode`` drawn on another machine, as the trainer gets it (train.rollout_worker = "remote"): its
    environment's ``get_reward()`` read there right after the rollout (a local run reads it when the rewards run:
    the same value for an environment whose reward depends on its conversation only), the conversation's messages
    and counters. The environment object stays on the worker's machine; ``env`` stands in for it.

    One difference from a local run's episodes: ``failure`` names a failed ``get_reward()`` even in a run whose
    rewards never read it (the worker has read it)."""

    env_name: str
    messages: list[dict]
    num_turns: int
    num_tool_calls: int
    num_tool_failures: int
    hit_max_turns: bool
    error: str | None
    reward_value: float | None
    reward_failure: str | None

    def reward(self) -> float | None:
        return self.reward_value

    @property
    def reward_error(self) -> str | None:
        return self.reward_failure

    @property
    def failure(self) -> str | None:
        return self.error or self.reward_failure

    @property
    def env(self) -> FarEnvironment:
        return FarEnvironment(self)

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: dict) -> EpisodeRecord:
        return cls(**{f.name: data[f.name] for f in fields(cls)})


class FarEnvironment:
    """Stands in for an environment left on a remote rollout worker's machine: ``get_reward()`` gives the value read
    there (raises its failure); any other attribute says where the environment is."""

    def __init__(self, record: EpisodeRecord):
        self._record = record

    def get_reward(self) -> float | None:
        if self._record.reward_failure is not None:
            raise RuntimeError(self._record.reward_failure)
        return self._record.reward_value

    def __getattr__(self, name: str):
        raise AttributeError(f"{self._record.env_name}.{name}: the environment lives on the remote rollout worker's "
                             "machine (train.rollout_worker = \"remote\"); the trainer gets its get_reward() value, the "
                             "conversation's messages and counters (turbogrpo.env.EpisodeRecord), or use the local worker")


def _direct(fn: Callable, *args):
    return fn(*args)


@dataclass
class EnvRollout:
    """A multi-turn rollout and its episodes (``episodes[i]`` is conversation i, group-major)."""

    rollout: MultiTurnRollout
    episodes: list[Episode] | list[EpisodeRecord]
    """The conversations' episodes (``EpisodeRecord``s where a remote rollout worker drew them)."""
    prompt_texts: list[str]
    """K rendered prompts."""
    metrics: dict[str, float]
    """env/turns, env/tool_calls, env/tool_failures, env/failures, env/max_turns_hit, env/template_drift
    (shares or means per conversation), env/env_tokens (per conversation), env/prefill_tokens_per_turn (ids the
    engine computed before each later turn, mean over those turns: the turn-end token and the reply on the native
    engine, what the prefix cache did not hold on vLLM; 0 without later turns)."""


_DRIFT_WARNED = False


def run_episodes(model: nn.Module, tokenizer: Any, rows: Sequence[dict], prompt_messages: Sequence[Sequence[dict]],
                 factory: str | Callable[[], Any], *, num_samples: int, sampling: SamplingConfig, max_turns: int,
                 limits: TurnLimits, tool_parser: str = "hermes", end_of_turn: str = "",
                 chat_template: str | None = None, seed: int | None = None, draft: object | None = None,
                 schedule: DecodeSchedule | None = None, reply_timing: str = "arrival",
                 branching: Sequence[int] = (), max_workers: int = 16, call_timeout_s: float | None = None,
                 generate: Callable[..., MultiTurnRollout] = generate_multiturn) -> EnvRollout:
    """G = ``num_samples`` episodes for each of the K dataset ``rows``, whose prompts are ``prompt_messages``
    (chat messages, ending on a user message); see the module docstring. ``schedule`` (its linear kernel),
    ``reply_timing`` and ``branching`` go to ``generate_multiturn``: under branching, ``branching[0]``
    environments are made per row and the others are forks of them (``Episode.fork``), probed right after
    ``reset`` so that one that cannot fork is refused before the rollout. Environment code (the factory,
    ``reset``, each turn, ``get_reward``) runs on ``max_workers`` daemon threads at most (1: one call at a
    time), each call limited to ``call_timeout_s`` seconds (None: no limit; past it, the conversation fails).
    ``generate``: the engine's multi-turn rollout, called as ``generate_multiturn`` (the native engine's; the vLLM
    engine passes its ``VllmEngine.generate_multiturn``)."""
    global _DRIFT_WARNED
    if len(rows) != len(prompt_messages):
        raise ValueError(f"got {len(rows)} rows for {len(prompt_messages)} prompts")
    if sampling.stop_strings:  # run_episodes ends turns on end_of_turn's token alone: never drop them silently
        raise ValueError(f"multi-turn rollouts end turns on the end-of-turn token; got stop_strings "
                         f"{list(sampling.stop_strings)} (remove them: rollout.stop_strings = [] with [env])")
    first = check_branching(branching, num_samples)[0]  # conversations started per row
    parser = get_tool_call_parser(tool_parser)
    make = load_factory(factory)
    calls = EnvCalls(max_workers, call_timeout_s)
    envs = []
    for _ in range(len(rows) * first):
        try:
            env = calls.call(make)
        except Exception as err:
            raise ValueError(f"[env] factory {factory!r} {_failure(err)}") from None
        check_environment(env, factory)
        if any(env is other for other in envs):  # conversations would share (and garble) one environment's state
            raise ValueError(f"[env] factory {factory!r} returned the same {type(env).__name__} object twice; each "
                             "conversation needs its own environment (make a new one on every call)")
        envs.append(env)
    end_of_turn = end_of_turn or tokenizer.eos_token
    renderers: dict[str, ChatRenderer] = {}  # one per distinct tool list (a factory's environments may differ)

    def renderer_of(tools: dict[str, Callable]) -> ChatRenderer:
        schemas = tool_schemas(tools)
        key = json.dumps(schemas, sort_keys=True, default=str)
        if key not in renderers:
            renderers[key] = ChatRenderer(tokenizer, schemas or None, end_of_turn, chat_template or None)
        return renderers[key]

    end_ids = tokenizer(end_of_turn, add_special_tokens=False)["input_ids"]
    if len(end_ids) != 1:
        raise ValueError(f"[env] end_of_turn {end_of_turn!r} must be one token of the tokenizer, got ids {end_ids}")

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    episodes = []
    for env in envs:
        tools = environment_tools(env)
        episodes.append(Episode(env, tools, renderer_of(tools), parser, decode, max_turns, calls=calls))
    prompts, prompt_texts = [], []
    for k, (row, messages) in enumerate(zip(rows, prompt_messages)):
        members = episodes[k * first:(k + 1) * first]
        observations = []
        for episode in members:
            episode.calling = "reset()"
            try:
                observations.append(calls.call(reset_environment, episode.env, dict(row)))
            except EnvironmentFault as err:  # this conversation fails; its siblings still run
                episode.error = str(err)
            except EnvCallFailed as err:
                episode.error = f"reset() {err}"
        if len(set(observations)) > 1:
            raise ValueError(f"reset() gave {len(set(observations))} different observations for the {first} "
                             f"conversations of row {k}; a GRPO group needs one prompt (seed the environment from the row)")
        renderer = members[0].renderer
        if any(episode.renderer is not renderer for episode in members):
            names = sorted({", ".join(episode.tools) or "none" for episode in members})
            raise ValueError(f"the {first} environments of row {k} offer different tools ({' / '.join(names)}); a GRPO "
                             "group needs one prompt, so the environments of one row must offer the same tools")
        messages = [dict(m) for m in messages]
        if observations and observations[0] is not None:
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observations[0]}
        for episode in members:
            episode.messages = [dict(m) for m in messages]
        text = renderer.render(messages, generation_prompt=True)
        prompt_texts.append(text)
        prompts.append(torch.tensor(renderer.encode(text), dtype=torch.long))
    sampling = SamplingConfig(**{**{f: getattr(sampling, f) for f in ("max_new_tokens", "temperature", "top_p",
                                                                          "top_k")},
                                 "stop_token_ids": tuple(dict.fromkeys((*sampling.stop_token_ids, end_ids[0])))})
    rollout = generate(model, prompts, episodes, num_samples=num_samples, sampling=sampling, limits=limits, seed=seed,
                       draft=draft, schedule=schedule, reply_timing=reply_timing, branching=branching, env_calls=calls)
    episodes = rollout.handlers  # under branching, the forks; otherwise the same episodes
    drifted = 0
    for i, episode in enumerate(episodes):
        if rollout.errors[i] is not None and episode.error is None:
            episode.error = rollout.errors[i]
            if rollout.errors[i].startswith(("EnvCallFailed: ", "EnvCallTimeout: ")):  # name the method it was in
                episode.error = f"{episode.calling} {rollout.errors[i].split(': ', 1)[1]}"
        if rollout.groups.finish_reasons[i] == "stop" and episode.error is None:
            recorded = torch.cat([rollout.groups.prompts[i // num_samples].cpu(), rollout.groups.completions[i]])
            drifted += renderer.drifts(episode.messages, recorded.tolist())
    if drifted and not _DRIFT_WARNED:
        _DRIFT_WARNED = True
        warnings.warn(f"{drifted} of {len(episodes)} conversations render differently under the chat template than "
                      "the ids the rollout recorded (tool-call formatting or whitespace); training uses the recorded "
                      "ids (metric env/template_drift)", stacklevel=2)
    n = len(episodes)
    metrics = {"env/turns": sum(e.num_turns for e in episodes) / n,
               "env/tool_calls": sum(e.num_tool_calls for e in episodes) / n,
               "env/tool_failures": sum(e.num_tool_failures for e in episodes) / n,
               "env/failures": sum(e.error is not None for e in episodes) / n,
               "env/max_turns_hit": sum(e.hit_max_turns for e in episodes) / n,
               "env/template_drift": drifted / n,
               "env/env_tokens": rollout.stats.num_env_tokens / n,
               "env/prefill_tokens_per_turn": mean_or_zero(rollout.stats.turn_prefill_tokens)}
    return EnvRollout(rollout, episodes, prompt_texts, metrics)


def mean_or_zero(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _failure(err: Exception) -> str:
    """What environment code did, for a message: ``raised X: ...``, or an ``EnvCallFailed``'s own text."""
    return str(err) if isinstance(err, EnvCallFailed) else f"raised {type(err).__name__}: {err}"


def environment_reward(prompts, completions, environments: Sequence[Episode | EpisodeRecord] | None = None,
                       **columns) -> list:
    """A reward function (``turbogrpo.rewards`` form) reading each episode's ``get_reward()``; a failed
    conversation or reward is that item's ``ItemFailure`` (its reason: which method failed and how), never the
    batch's failure."""
    if environments is None:
        raise ValueError("environment_reward needs the 'environments' column (the rollout's episodes)")
    values = []
    for episode in environments:
        value = episode.reward()
        values.append(value if value is not None else ItemFailure(f"{episode.env_name}: {episode.reward_error}"))
    return values
