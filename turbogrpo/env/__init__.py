"""Environments for multi-turn, tool-using GRPO (TRL's ``environment_factory`` interface, and a feedback
protocol): see ``environment.py`` for the interface, ``episode.py`` for the rollout, ``tasks.py`` for the
built-in environments.

    from turbogrpo.env import run_episodes
    result = run_episodes(model, tokenizer, rows, prompt_messages, "my_pkg.envs:Calculator", num_samples=4,
                          sampling=SamplingConfig(max_new_tokens=64), max_turns=3,
                          limits=TurnLimits(max_turn_tokens=64, max_conversation_tokens=256))
    result.rollout.groups.model_mask    # per conversation: True on sampled ids, False on tool replies
"""

from turbogrpo.env.chat import ChatRenderer
from turbogrpo.env.environment import bind_positional, call_tool, environment_tools, load_factory, tool_schemas
from turbogrpo.env.episode import EnvRollout, Episode, EpisodeRecord, environment_reward, run_episodes
from turbogrpo.env.tool_calls import TOOL_CALL_PARSERS, ToolCall, get_tool_call_parser
from turbogrpo.rollout.multiturn import TurnLimits

__all__ = ["ChatRenderer", "EnvRollout", "Episode", "EpisodeRecord", "TOOL_CALL_PARSERS", "ToolCall", "TurnLimits", "bind_positional",
           "call_tool", "environment_reward", "environment_tools", "get_tool_call_parser", "load_factory", "run_episodes",
           "tool_schemas"]
