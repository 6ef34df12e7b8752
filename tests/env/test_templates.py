"""The renderer is checked against the chat template once, before any rollout: an end-of-turn token that is
not the template's, a template without one, or one that drops replies is refused in one line; stop strings
with an environment are refused; the conversation limit is named by its own setting."""

import pytest

from tests.env.test_episode import LIMITS, demo, episodes, rows_and_messages  # noqa: F401 (fixture)
from tests.train.test_multiturn_run import CONFIG, one_thread, small  # noqa: F401 (autouse fixture: restores torch threads)
from turbogrpo.config import ConfigError, load_config
from turbogrpo.env import run_episodes
from turbogrpo.env.tasks import DEMO_CHAT_TEMPLATE, Calculator, RetryArithmetic
from turbogrpo.rollout import SamplingConfig
from turbogrpo.train import loop

TOOL_BRANCH = "{%- elif message.role == 'tool' -%}{{ '\nResult: ' ~ message.content ~ '\nAnswer:' }}"
assert TOOL_BRANCH in DEMO_CHAT_TEMPLATE


@pytest.mark.parametrize("end_of_turn, template, env, line", [
    # One token, but the template's turn header: ":y<|endoftext|>" would be prefilled into every reply.
    ("Answer", DEMO_CHAT_TEMPLATE, RetryArithmetic, "env.end_of_turn 'Answer' must be the token the chat template "
                                                    "puts right after an assistant's text, but .* has it elsewhere"),
    ("<|pad|>", DEMO_CHAT_TEMPLATE, RetryArithmetic, "env.end_of_turn '<|pad|>' must be .* does not contain it"),
    ("", DEMO_CHAT_TEMPLATE.replace("<|endoftext|>", ""), RetryArithmetic,
     "env.end_of_turn '<|endoftext|>' must be .* does not contain it"),
    ("", DEMO_CHAT_TEMPLATE.replace(TOOL_BRANCH, ""), Calculator,
     "the chat template drops tool messages .* set env.chat_template to one that renders role 'tool'"),
    ("", DEMO_CHAT_TEMPLATE.replace("{{ '\n' if not loop.first }}{{ message.content }}", ""), RetryArithmetic,
     "the chat template drops user messages"),
])
def test_a_template_the_renderer_cannot_use_is_refused_before_the_rollout(demo, end_of_turn, template, env, line):
    with pytest.raises(ValueError, match=line):
        episodes(demo, env, num_rows=1, end_of_turn=end_of_turn, template=template)


def test_stop_strings_with_an_environment_are_refused(demo, tmp_path):
    with pytest.raises(ConfigError, match=r"config key 'rollout.stop_strings'.* with an \[env\] factory"):
        load_config(CONFIG, small(tmp_path / "run", **{"rollout.stop_strings": '["####"]'}))
    model, tokenizer = demo
    rows, messages = rows_and_messages(1)
    with pytest.raises(ValueError, match=r"got stop_strings \['####'\]"):
        run_episodes(model, tokenizer, rows, messages, RetryArithmetic, num_samples=2, max_turns=2, limits=LIMITS,
                     sampling=SamplingConfig(max_new_tokens=8, stop_strings=("####",), tokenizer=tokenizer), chat_template=DEMO_CHAT_TEMPLATE)


def test_a_conversation_limit_past_the_model_names_its_own_setting(tmp_path):
    config = load_config(CONFIG, small(tmp_path / "run", **{"env.max_conversation_tokens": 1000000}))
    with pytest.raises(ConfigError, match=r"config key 'env.max_conversation_tokens': 1000000 leaves no room"):
        loop.train(config)
