"""The [env] section's part of a run: each step's conversations, G per prompt, each with its own
environment (``turbogrpo.env.run_episodes``), built once from the section (``build_episode_sampler``).

With it, a step samples conversations instead of single completions: the prompt is the row's chat messages
(with the environment's first observation and tools) rendered by the chat template, the completion is every
id after it, model tokens (``model_mask`` 1, with the sampler's log-probs) and environment replies (0)
interleaved as the engine ran them, and each conversation's episode (``Episode``) goes to the rewards as the
``environments`` column (the built-in reward "environment" reads its ``get_reward()``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from turbogrpo.config import EnvConfig
from turbogrpo.data import PromptExample
from turbogrpo.env import EnvRollout, TurnLimits, load_factory, run_episodes
from turbogrpo.env.tasks import CHAT_TEMPLATES
from turbogrpo.rollout import SamplingConfig
from turbogrpo.rollout.decode import DecodeSchedule
from turbogrpo.rollout.multiturn import MultiTurnRollout, generate_multiturn


@dataclass(frozen=True)
class EpisodeSampler:
    """How a run's conversations are sampled (the [env] section, resolved)."""

    factory: str
    """``package.module:callable`` making one environment per conversation."""
    max_turns: int
    tool_parser: str
    limits: TurnLimits
    end_of_turn: str
    """The end-of-turn token's text ("" reads the tokenizer's eos token)."""
    reply_timing: str
    """``rollout.multiturn.REPLY_TIMINGS`` key; "next_step" keeps a seeded rollout reproducible."""
    branching: tuple[int, ...] = ()
    """rollout.branching: the training rollouts' fork factors (() unbranched)."""
    max_workers: int = 16
    """Most environment calls at once (1: serial)."""
    call_timeout_s: float | None = None
    """Each environment call's time limit in seconds (None: none)."""

    @property
    def max_completion_tokens(self) -> int:
        """The most ids after a prompt (model and environment together)."""
        return self.limits.max_conversation_tokens

    def sample(self, model: nn.Module, tokenizer, examples: Sequence[PromptExample], *, num_samples: int,
               sampling: SamplingConfig, seed: int | None, schedule: DecodeSchedule | None = None,
               branched: bool = False, draft: object | None = None,
               generate: Callable[..., MultiTurnRollout] = generate_multiturn) -> EnvRollout:
        """``num_samples`` conversations for each of ``examples`` (group-major) with ``model``'s weights, the
        rows' other columns going to the environments' ``reset(**row)``. ``branched``: fork them by
        ``branching`` (training rollouts; held-out evaluation samples its own G unbranched). ``draft``: a
        ``turbogrpo.speculative.Speculation`` decodes the model's turns speculatively (None: plain). ``generate``:
        the engine's multi-turn rollout (``run_episodes``)."""
        missing = [e.index for e in examples if e.messages is None]
        if missing:
            raise ValueError(f"rows {missing[:3]} have no chat messages; multi-turn prompts need the chat template "
                             "(data.chat_template = \"auto\" with a tokenizer that has one, or set [env] chat_template)")
        return run_episodes(model, tokenizer, [dict(e.columns) for e in examples], [list(e.messages) for e in examples],
                            self.factory, num_samples=num_samples, sampling=sampling, max_turns=self.max_turns,
                            limits=self.limits, tool_parser=self.tool_parser, end_of_turn=self.end_of_turn,
                            seed=seed, schedule=schedule, reply_timing=self.reply_timing,
                            branching=self.branching if branched else (), draft=draft,
                            max_workers=self.max_workers, call_timeout_s=self.call_timeout_s, generate=generate)


def build_episode_sampler(env: EnvConfig, tokenizer, branching: Sequence[int] = ()) -> EpisodeSampler | None:
    """The [env] section's sampler, None while ``env.factory`` is "" (single-turn completions). The factory is
    imported here, so a bad one is named before any step; ``env.chat_template`` (Jinja text, or the name of
    one in ``env.tasks.CHAT_TEMPLATES``) becomes the tokenizer's chat template, so that prompts, rollouts and
    the exported model all use the template the run trained with. ``branching``: rollout.branching."""
    if not env.factory:
        return None
    load_factory(env.factory)
    if env.chat_template:
        tokenizer.chat_template = CHAT_TEMPLATES.get(env.chat_template, env.chat_template)
    return EpisodeSampler(env.factory, env.max_turns, env.tool_parser,
                          TurnLimits(env.max_turn_tokens, env.max_conversation_tokens, feed_width=env.feed_width), env.end_of_turn,
                          env.reply_timing, tuple(branching), env.max_workers, env.call_timeout_s or None)
