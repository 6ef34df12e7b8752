"""Tree sharing in the TRL drop-in: multi-turn rows whose completions begin alike run their common tokens
once (one trie per call), with TRL's loss and gradients.

The rows are TRL's own tool loop on scripted model turns (``test_trl_tools``): the members of a group make
the same first tool call, so the deterministic tool or environment gives them the same reply, and they part
only in a later turn. One tokenizer pads with its EOS (TRL #4974): every real completion ends in a token
that is also the padding id, so only the attention mask tells the two apart.
"""

import copy

import pytest
import torch

trl = pytest.importorskip("trl", minversion="1.16")

from tests.integrations.test_trl_tools import (END, ENV_COLUMNS, QUESTIONS, RunningTotal, add,  # noqa: E402
                                               assert_trains_as_trl, build_trainer, call, chat, fixed_rewards,
                                               generation_batch, multiply)
from turbogrpo.integrations.trl import (SharedPrefixGRPOTrainer, enable_shared_prefix,  # noqa: E402
                                        prompt_shared_tokens, split_groups)

__all__ = ["chat"]  # the fixture, imported for its use here

G = 3
# Rows 3g..3g+2 are group g. Within a group the first turn is the same call (the same reply follows), then
# the turns part; group 2's first row makes a second, different call, and its third answers at once.
TREE_TOOL_SCRIPTS = [
    [call("add", a=3, b=4) + END, "#### 7" + END],
    [call("add", a=3, b=4) + END, "It is 7.\n#### 7" + END],
    [call("add", a=3, b=4) + END, call("add", a=7, b=0) + END, "#### 7" + END],
    [call("multiply", a=12, b=5) + END, "#### 60" + END],
    [call("multiply", a=12, b=5) + END, "#### 60" + END],    # the same row twice: the trie holds it once
    [call("multiply", a=12, b=5) + END, "The product is 60.\n#### 60" + END],
    [call("add", a=8, b=9) + END, call("multiply", a=17, b=2) + END, "#### 34" + END],
    [call("add", a=8, b=9) + END, call("multiply", a=17, c=2) + END, "#### 34" + END],   # a bad argument
    ["#### 34" + END],
]
# The environment's rows: same reset per group (same start), same first call; row 5 never ends its last turn
# (truncated: TRL masks the whole row, which then joins no group).
TREE_ENV_SCRIPTS = [
    [call("add_to_total", amount=2) + END, "Done." + END],
    [call("add_to_total", amount=2) + END, call("add_to_total", amount=1) + END, "Done." + END],
    [call("add_to_total", amount=2) + END, "Finished." + END],
    [call("add_to_total", amount=5) + END, "Done." + END],
    [call("add_to_total", amount=5) + END, "Done!" + END],
    [call("add_to_total", amount=5) + END, "Still counti"],
    [call("add_to_total", amount=3) + call("add_to_total", amount=4) + END, "Done." + END],
    [call("add_to_total", amount=3) + call("add_to_total", amount=4) + END, call("add_to_total", step=1) + END,
     "Done." + END],
    ["Done." + END],
]
TREE_VARIANTS = {
    "tools": dict(kwargs=lambda: dict(tools=[add, multiply], reward_funcs=[fixed_rewards]),
                  scripts=TREE_TOOL_SCRIPTS, columns={}),
    "environment": dict(kwargs=lambda: dict(environment_factory=RunningTotal), scripts=TREE_ENV_SCRIPTS,
                        columns=ENV_COLUMNS, config={"mask_truncated_completions": True}),
}


@pytest.fixture(scope="module")
def chat_pad_is_eos(chat):
    """``chat``'s model and tokenizer, the tokenizer padding with its EOS ``<|im_end|>``."""
    model_dir, tokenizer = chat
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.pad_token = END
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    return model_dir, tokenizer


@pytest.mark.parametrize(("variant", "pad_is_eos", "sharing"), [
    ("tools", False, "auto"),
    ("environment", True, "tree"),
], ids=["tools-auto", "environment-pad-is-eos-tree"])
def test_rows_that_share_turns_train_as_trl_through_one_trie(chat, chat_pad_is_eos, tmp_path, variant, pad_is_eos,
                                                             sharing):
    tokenizer_pair = chat_pad_is_eos if pad_is_eos else chat
    spec = TREE_VARIANTS[variant]
    trl_trainer = build_trainer(tokenizer_pair, tmp_path / "trl", trl.GRPOTrainer, spec)
    ours = build_trainer(tokenizer_pair, tmp_path / "ours", SharedPrefixGRPOTrainer, spec, sharing=sharing)
    trl_batch, our_batch = generation_batch(trl_trainer), generation_batch(ours)
    if pad_is_eos:   # the padding is EOS ids too: only the mask ends a completion
        lengths = our_batch["completion_mask"].sum(1)
        padded = lengths < our_batch["completion_ids"].shape[1]
        assert padded.sum() >= 3 and (our_batch["completion_ids"][padded, -1] == tokenizer_pair[1].eos_token_id).all()
    assert_trains_as_trl(trl_trainer, ours, trl_batch, our_batch, ("tools/call_frequency", "tools/failure_frequency"))
    stats = ours.shared_prefix_stats
    # old policy, reference, policy: every call ran one trie, which ran fewer tokens than prompt sharing would
    assert stats.num_fallback_calls == 0 and stats.num_shared_calls == stats.num_tree_calls == 3
    groups, _ = shared_groups(ours, our_batch)
    assert stats.num_tokens_run < 3 * prompt_shared_tokens(groups) < stats.num_row_tokens


def test_tree_logprobs_and_entropies_equal_trl_row_by_row_in_chunks(chat_pad_is_eos, tmp_path):
    """The drop-in's ``[B, C]`` log-probs and entropies through tries cut into ``batch_size`` chunks of whole
    groups (batch_size=2: each group a chunk, so a trie, of its own) equal TRL's own method's on the same call,
    0 at the padding; pad == eos."""
    ours = build_trainer(chat_pad_is_eos, tmp_path, SharedPrefixGRPOTrainer, TREE_VARIANTS["environment"],
                         sharing="tree")
    batch = generation_batch(ours)
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    call = dict(logits_to_keep=batch["completion_ids"].shape[1], batch_size=2, compute_entropy=True)
    before = ours.shared_prefix_stats.num_tree_calls
    logps, entropies, _ = ours._get_per_token_logps_and_entropies(ours.model, input_ids, attention_mask, **call)
    assert ours.shared_prefix_stats.num_tree_calls - before == 3   # the 3 groups, one trie each
    trl_logps, trl_entropies, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(ours, ours.model, input_ids,
                                                                                     attention_mask, **call)
    mask = batch["completion_mask"].bool()
    assert logps.shape == trl_logps.shape and entropies.shape == trl_entropies.shape
    torch.testing.assert_close(logps[mask], trl_logps[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropies[mask], trl_entropies[mask], rtol=1e-5, atol=1e-5)
    assert (logps[~mask] == 0).all() and (entropies[~mask] == 0).all() and (~mask).sum() > 0
    assert logps.requires_grad and not entropies.requires_grad


def shared_groups(trainer, batch):
    """The groups the drop-in reads off a generation batch, in one chunk."""
    from turbogrpo.integrations.trl import group_rows
    groups, rows = group_rows(batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                              batch["completion_mask"])
    [(chunk, _)] = split_groups(groups, rows, None)
    return chunk, rows


def test_sharing_prompt_runs_no_trie_and_auto_takes_it_for_a_common_system_prompt(chat, tmp_path):
    """``sharing="prompt"`` never builds the trie. ``"auto"`` takes the trie even for one-turn rows whose first
    tokens differ within each group: the three questions' prompts begin with the same system turn (the tool
    schema), which the trie runs once across groups (``test_trl.py``'s prompts differ from their first token,
    and there ``"auto"`` shares prompts only)."""
    spec = TREE_VARIANTS["tools"]
    ours = enable_shared_prefix(build_trainer(chat, tmp_path / "prompt", trl.GRPOTrainer, spec), sharing="prompt")
    batch = generation_batch(ours)
    groups, _ = shared_groups(ours, batch)
    assert ours.shared_prefix_stats.num_tree_calls == 0 and ours.shared_prefix_stats.num_shared_calls == 2
    assert ours.shared_prefix_stats.num_tokens_run == 2 * prompt_shared_tokens(groups)
    distinct = {**spec, "scripts": [[f"{i}" + END] for i in range(9)]}   # the first tokens differ in a group
    auto = build_trainer(chat, tmp_path / "auto", SharedPrefixGRPOTrainer, distinct)
    groups, _ = shared_groups(auto, generation_batch(auto))
    stats = auto.shared_prefix_stats
    assert stats.num_shared_calls == stats.num_tree_calls == 2
    system_turn = len(chat[1].apply_chat_template([{"role": "user", "content": ""}], tools=[add, multiply],
                                                  tokenize=True, return_dict=False)) // 2
    assert stats.num_tokens_run < 2 * (prompt_shared_tokens(groups) - 2 * system_turn)


def test_bad_sharing_is_one_clear_line(chat, tmp_path):
    with pytest.raises(ValueError, match=r"sharing must be one of \['auto', 'prompt', 'tree'\] \(a string\), got 'trie'"):
        SharedPrefixGRPOTrainer(model="unused", sharing="trie")
    with pytest.raises(ValueError, match=r"sharing must be one of .* \(a string\), got \['tree'\]"):  # not unhashable
        SharedPrefixGRPOTrainer(model="unused", sharing=["tree"])
    with pytest.raises(ValueError, match="sharing must be one of"):
        enable_shared_prefix(build_trainer(chat, tmp_path, trl.GRPOTrainer, TREE_VARIANTS["tools"]), sharing=None)
