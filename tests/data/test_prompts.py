import pytest

from turbogrpo.data.prompts import build_prompts

ROWS = [{"prompt": "What is 2+2?", "answer": "4", "id": 0},
        {"question": "What is 3+4?", "prompt": "What is 3+4? Think step by step, please.", "answer": "7", "id": 1}]


def test_raw_text_without_template_and_columns_pass_through(byte_tokenizer):
    result = build_prompts(ROWS, byte_tokenizer)
    first = result.examples[0]
    assert first.text == "What is 2+2?"
    assert first.token_ids.tolist() == byte_tokenizer("What is 2+2?")["input_ids"]
    assert first.columns == {"answer": "4", "id": 0}
    assert result.examples[1].columns == {"question": "What is 3+4?", "answer": "7", "id": 1}
    assert (result.num_too_long, result.num_empty) == (0, 0)


def test_chat_template_applied_when_present(chat_tokenizer):
    result = build_prompts(ROWS[:1], chat_tokenizer, system_prompt="Be brief.")
    assert result.examples[0].text == "<system>Be brief.<eos><user>What is 2+2?<eos><assistant>"
    messages = [{"role": "user", "content": "Hi"}]
    assert build_prompts([{"prompt": messages}], chat_tokenizer).examples[0].text == "<user>Hi<eos><assistant>"
    assert build_prompts(ROWS[:1], chat_tokenizer, chat_template=False).examples[0].text == "What is 2+2?"


def test_chat_template_required_but_missing(byte_tokenizer):
    with pytest.raises(ValueError, match="no chat template"):
        build_prompts(ROWS, byte_tokenizer, chat_template=True)
    with pytest.raises(ValueError, match="chat template"):
        build_prompts([{"prompt": [{"role": "user", "content": "Hi"}]}], byte_tokenizer)


def test_too_long_prompts_skipped_and_counted_or_error(byte_tokenizer):
    limit = len(byte_tokenizer(ROWS[0]["prompt"])["input_ids"])
    result = build_prompts(ROWS, byte_tokenizer, max_prompt_tokens=limit)
    assert [e.index for e in result.examples] == [0]
    assert result.num_too_long == 1
    with pytest.raises(ValueError, match=r"row 1: prompt has \d+ tokens"):
        build_prompts(ROWS, byte_tokenizer, max_prompt_tokens=limit, on_too_long="error")


def test_empty_prompts_raise_or_are_skipped(byte_tokenizer):
    rows = [{"prompt": "  "}, {"prompt": None}, {"other": 1}, {"prompt": "ok"}]
    with pytest.raises(ValueError, match="row 0: prompt column 'prompt' is empty"):
        build_prompts(rows, byte_tokenizer)
    result = build_prompts(rows, byte_tokenizer, on_empty="skip")
    assert [e.text for e in result.examples] == ["ok"]
    assert result.num_empty == 3


def test_bad_settings_name_the_field(byte_tokenizer):
    with pytest.raises(ValueError, match="prompt column 'text' is in no row"):
        build_prompts(ROWS, byte_tokenizer, prompt_column="text")
    with pytest.raises(ValueError, match="on_too_long"):
        build_prompts(ROWS, byte_tokenizer, on_too_long="truncate")
    with pytest.raises(ValueError, match="must be a string or a list"):
        build_prompts([{"prompt": 3}], byte_tokenizer)


def test_prompts_too_long_for_the_model_follow_the_overlong_rule(byte_tokenizer):
    lengths = [len(byte_tokenizer(r["prompt"])["input_ids"]) for r in ROWS]
    max_positions = lengths[0] + 4  # room for the short prompt and 4 new tokens, not for the long one
    result = build_prompts(ROWS, byte_tokenizer, max_positions=max_positions, max_new_tokens=4)
    assert [e.index for e in result.examples] == [0] and result.num_too_long == 1
    assert build_prompts(ROWS, byte_tokenizer, max_positions=max_positions, max_new_tokens=5).num_too_long == 2
    with pytest.raises(ValueError, match=rf"row 1: prompt has {lengths[1]} tokens, which with max_new_tokens=4 is "
                                         rf"more than the model's {max_positions} positions "
                                         r"\(max_position_embeddings\); "
                                         r"to skip such rows set the config key data.on_overlong = \"skip\""):
        build_prompts(ROWS, byte_tokenizer, max_positions=max_positions, max_new_tokens=4, on_too_long="error")


def test_the_empty_prompt_advice_names_a_real_config_key(byte_tokenizer):
    from turbogrpo.config import load_config
    key = 'data.on_empty = "skip"'
    with pytest.raises(ValueError, match=f"row 0: prompt column 'prompt' is empty; to skip such rows set the config "
                                         f"key {key}"):
        build_prompts([{"prompt": " "}], byte_tokenizer)
    assert load_config(None, [key.replace(" ", "")]).data.on_empty == "skip"


@pytest.mark.parametrize("message, problem", [
    ({"content": "Tom has 3 apples"}, "has no role"),
    ({"role": "user", "content": [1, 2]}, "has list content, not a string"),
    ({"role": "user", "content": 7}, "has int content, not a string"),
    ({"role": "user"}, "has no content"),
    ({"role": 3, "content": "hi"}, "has role 3, not a non-empty string"),
])
def test_chat_messages_need_a_role_and_text_content(chat_tokenizer, message, problem):
    rows = [{"prompt": "fine"}, {"prompt": [{"role": "system", "content": "Be brief."}, message]}]
    with pytest.raises(ValueError, match=rf"row 1: message 1 of prompt column 'prompt' {problem}; each message is"):
        build_prompts(rows, chat_tokenizer)


def test_a_chat_template_that_refuses_a_prompt_is_one_line_naming_the_row(chat_tokenizer):
    chat_tokenizer.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    rows = [{"prompt": "fine"}, {"prompt": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}]
    with pytest.raises(ValueError, match=r"row 1: the tokenizer's chat template refused the prompt \(Conversation "
                                         r"roles must alternate .*\); fix the row's messages \(and "
                                         r"data.system_prompt\) to what the template accepts$") as err:
        build_prompts(rows, chat_tokenizer)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"row 0: the tokenizer's chat template refused .* or set the config key "
                                         r"data.chat_template = \"never\""):  # a system prompt it refuses
        build_prompts(rows[:1], chat_tokenizer, system_prompt="Be brief.")


def test_template_errors_name_the_config_key(byte_tokenizer):
    with pytest.raises(ValueError, match=r"data.chat_template = \"always\" but the tokenizer has no chat template; "
                                         r"set the config key data.chat_template = \"auto\" .* or \"never\""):
        build_prompts(ROWS, byte_tokenizer, chat_template=True)
    with pytest.raises(ValueError, match=r"needs the tokenizer's chat template, which is off or missing; set the "
                                         r"config key data.chat_template = \"auto\""):
        build_prompts([{"prompt": [{"role": "user", "content": "Hi"}]}], byte_tokenizer)
