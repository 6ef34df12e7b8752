"""The SmolLM2 tool tasks: seeded rows with held-out splits, answers that are the arithmetic, and a chat
template whose rendered tool calls the pythonic parser reads back."""

from collections import Counter

from transformers.utils.chat_template_utils import render_jinja_template

from turbogrpo.data.tool_tasks import CALCULATOR_SHOT, calculator_records, guess_number_records
from turbogrpo.env import TOOL_CALL_PARSERS, ToolCall, bind_positional, environment_tools, tool_schemas
from turbogrpo.env.tasks import CHAT_TEMPLATES, Calculator, evaluate_arithmetic


def _question(row: dict) -> str:
    return row["prompt"][-1]["content"].removeprefix("What is ").removesuffix("?")


def test_calculator_rows_are_seeded_held_out_and_answered_by_their_arithmetic():
    assert calculator_records("train", 40, seed=1) == calculator_records("train", 40, seed=1)
    assert calculator_records("train", 40, seed=1) != calculator_records("train", 40, seed=2)
    train = calculator_records("train", 1000, seed=0)
    held_out = calculator_records("eval", 100, seed=0)
    assert len({_question(r) for r in held_out}) == 100
    assert not {_question(r) for r in train} & {_question(r) for r in held_out}
    for row in train[:50] + held_out[:50]:
        assert int(row["answer"]) == evaluate_arithmetic(_question(row))
        assert row["prompt"][0]["role"] == "system" and row["prompt"][-1]["role"] == "user"


def test_guess_number_rows_ask_every_secret_equally_often():
    counts = Counter(r["secret"] for r in guess_number_records("train", 64, seed=3))
    assert sorted(counts) == list(range(1, 17)) and set(counts.values()) == {4}
    assert guess_number_records("eval", 32, seed=0) == guess_number_records("eval", 32, seed=5)


def test_smollm2_tools_template_renders_calls_the_pythonic_parser_reads_back():
    env = Calculator()
    tools = environment_tools(env)
    row = calculator_records("eval", 1)[0]
    text = render_jinja_template([row["prompt"]], tools=tool_schemas(tools),
                                 chat_template=CHAT_TEMPLATES["smollm2_tools"], add_generation_prompt=True)[0][0]
    assert text.startswith("<|im_start|>system\n" + row["prompt"][0]["content"])
    assert "- calculate(expression): Evaluate an arithmetic expression." in text
    assert text.endswith("<|im_start|>user\n" + row["prompt"][-1]["content"] + "<|im_end|>\n<|im_start|>assistant\n")
    call_turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = TOOL_CALL_PARSERS["pythonic"](call_turn)
    assert content == "" and calls == [ToolCall("calculate", {}, positional=("37 * 52 - 18",))]
    assert bind_positional(tools, calls[0]) == ToolCall("calculate", CALCULATOR_SHOT[1]["tool_calls"][0]["function"]
                                                        ["arguments"])
    assert "<|im_start|>tool\n1906<|im_end|>" in text
