"""Chat-template rendering for multi-turn rollouts: the first prompt, each environment reply's ids, and
the check that the recorded ids are what the template would render.

The recorded ids are the training data; the template is asked only for the ids of what the environment
adds. A reply's ids are cut out of a rendering of a minimal conversation, at the end of its last
assistant turn: ``render([user, assistant] + reply, generation prompt)`` minus ``render([user,
assistant])`` up to and including its last end-of-turn token (templates add a newline after it that the
model never sampled, and the model's own turn ends on that token). The cut falls right after a special
token, where tokenising the parts alone gives the ids tokenising the whole would.

Shapes: ids are host lists of ints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_PROBE = [{"role": "user", "content": "hi"}]
_PROBE_ANSWER = "probe answer"
_PROBE_REPLY = "probe reply"


class ChatRenderer:
    """The chat template of ``tokenizer`` (or ``chat_template``, which overrides it) with the tools' schemas."""

    def __init__(self, tokenizer: Any, tools: Sequence[dict] | None, end_of_turn: str,
                 chat_template: str | None = None):
        """``end_of_turn``: the text of the token that ends an assistant turn (e.g. ``<|im_end|>``)."""
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.end_of_turn = end_of_turn
        self.chat_template = chat_template
        if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; set [env] chat_template (a Jinja template) to "
                             "render multi-turn conversations")
        if self.tools and self.render(_PROBE, tools=self.tools) == self.render(_PROBE, tools=None):
            raise ValueError(f"the chat template ignores tools= (the {len(self.tools)} environment tools would never "
                             "reach the model); set [env] chat_template to a template that renders tools")
        self.check_round_trip()

    def check_round_trip(self) -> None:
        """ValueError in one line unless the template ends an assistant turn with ``end_of_turn`` right after
        its text, and an environment's reply (a user message; a tool result when there are tools) comes back
        out of ``reply_ids`` (checked once, before any rollout: a wrong end-of-turn token would otherwise put
        the template's own text into every reply, or fail every conversation)."""
        turn = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE_ANSWER}])
        cut = turn.rfind(self.end_of_turn)
        if cut < 0 or not turn[:cut].rstrip().endswith(_PROBE_ANSWER):
            where = "does not contain it" if cut < 0 else f"has it elsewhere ({turn[-60:]!r})"
            raise ValueError(f"env.end_of_turn {self.end_of_turn!r} must be the token the chat template puts right "
                             f"after an assistant's text, but its rendering of an assistant turn {where}; set env."
                             "end_of_turn to the template's end-of-turn token (or env.chat_template to a template "
                             "with one)")
        replies = [([{"role": "user", "content": _PROBE_REPLY}], ())]
        if self.tools:
            name = self.tools[0].get("function", self.tools[0]).get("name", "tool")
            replies.append(([{"role": "tool", "name": name, "content": _PROBE_REPLY}],
                            ({"type": "function", "function": {"name": name, "arguments": {}}},)))
        for reply, calls in replies:
            role = reply[0]["role"]
            try:
                text = self.tokenizer.decode(self.reply_ids(reply, calls))
            except Exception as err:
                raise ValueError(f"the chat template cannot render a {role} message after an assistant turn "
                                 f"({type(err).__name__}: {err}); set env.chat_template to one that does") from None
            if _PROBE_REPLY not in text:
                raise ValueError(f"the chat template drops {role} messages (an environment's {role} reply would never "
                                 f"reach the model: rendered {text!r}); set env.chat_template to one that renders "
                                 f"role {role!r}")

    def render(self, messages: Sequence[dict], *, generation_prompt: bool = False, tools: Any = "default") -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tools=self.tools if tools == "default" else tools, tokenize=False,
            add_generation_prompt=generation_prompt, chat_template=self.chat_template)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """The conversation's ids up to the first assistant turn's header."""
        return self.encode(self.render(messages, generation_prompt=True))

    def reply_ids(self, reply: Sequence[dict], calls: Sequence[dict] = ()) -> list[int]:
        """Ids of ``reply`` (the environment's messages after an assistant turn, whose end-of-turn token
        the model already sampled) and of the next assistant header. ``calls``: the turn's tool calls
        (message form), which some templates need to render tool replies."""
        before = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", **(
            {"tool_calls": list(calls)} if calls else {})}]
        prefix = self.render(before)
        full = self.render([*before, *reply], generation_prompt=True)
        cut = prefix.rfind(self.end_of_turn)
        if cut < 0 or not full.startswith(prefix[:cut + len(self.end_of_turn)]):
            raise ValueError(f"the chat template does not end an assistant turn with {self.end_of_turn!r} as a "
                             "prefix of the next turn; set [env] end_of_turn to the template's end-of-turn token")
        return self.encode(full[cut + len(self.end_of_turn):])

    def drifts(self, messages: Sequence[dict], recorded: Sequence[int]) -> bool:
        """Whether rendering ``messages`` (the whole conversation, ending on an assistant turn) gives other
        ids than ``recorded`` (prompt and completion ids as the engine ran them)."""
        rendered = self.encode(self.render(messages))
        return list(rendered[:len(recorded)]) != list(recorded)
