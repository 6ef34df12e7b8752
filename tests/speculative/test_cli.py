"""``turbogrpo draft train`` and ``turbogrpo profile`` on a tiny saved model."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.speculative.speculative_helpers import tiny_policy
from turbogrpo.speculative.cli import main
from turbogrpo.speculative.draft import DraftHead


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny policy with a character-level tokenizer of 64 symbols, saved like a real model."""
    folder = tmp_path_factory.mktemp("model")
    symbols = ["<eos>"] + [chr(ord("0") + i) for i in range(63)]
    backend = Tokenizer(models.WordLevel({s: i for i, s in enumerate(symbols)}, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<eos>")
    tokenizer.save_pretrained(folder)
    tiny_policy().save_pretrained(folder)
    return folder


def test_draft_train_then_profile(model_dir, tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in ("1234", "abc5", "zz9", "0")))
    out = tmp_path / "draft"
    assert main(["draft", "train", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(out),
                 "--num-samples", "2", "--max-new-tokens", "8", "--epochs", "2", "--batch-size", "4"]) == 0
    assert "draft saved to" in capsys.readouterr().out
    from turbogrpo.models import load_model_and_tokenizer
    policy, _ = load_model_and_tokenizer(model_dir)
    DraftHead.load(out, policy)

    monkeypatch.setenv("TURBOGRPO_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["profile", "--model", str(model_dir), "--draft", str(out), "--context-length", "8",
                 "--max-tokens", "4"]) == 0
    printed = capsys.readouterr().out
    assert "C_peak (knee) =" in printed and "draft ms" in printed
    assert (tmp_path / "cache" / "latency_profiles.json").is_file()


def test_bad_arguments_exit_with_a_message(model_dir, tmp_path, capsys):
    assert main(["draft", "train", "--model", str(model_dir), "--out", str(tmp_path / "d"), "--epochs", "0"]) == 2
    assert "--epochs must be >= 1" in capsys.readouterr().err
