"""``turbogrpo draft train`` and ``turbogrpo profile`` on a tiny saved model."""

import json

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.speculative.speculative_helpers import tiny_policy
from turbogrpo.commands.draft import main
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

    monkeypatch.setenv("TURBOGRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TURBOGRPO_CACHE_DIR", raising=False)
    assert main(["profile", "--model", str(model_dir), "--draft", str(out), "--context-length", "8",
                 "--max-tokens", "4"]) == 0
    printed = capsys.readouterr().out
    assert "C_peak (knee) =" in printed and "draft ms" in printed
    assert (tmp_path / "cache" / "latency_profiles.json").is_file()


def test_bad_arguments_exit_with_a_message(model_dir, tmp_path, capsys):
    assert main(["draft", "train", "--model", str(model_dir), "--out", str(tmp_path / "d"), "--epochs", "0"]) == 2
    assert "--epochs must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--lr", "inf"), ("--lr", "nan"), ("--temperature", "inf")])
def test_draft_train_refuses_numbers_that_are_not_finite(model_dir, tmp_path, capsys, flag, value):
    # An inf learning rate used to train, turn every weight to inf/NaN and say "draft saved".
    assert main(["draft", "train", "--model", str(model_dir), "--out", str(tmp_path / "d"), flag, value]) == 2
    assert f"{flag} must be a finite number" in capsys.readouterr().err
    assert not (tmp_path / "d" / "draft.safetensors").exists()


def draft_train(model_dir, prompts, out, *flags):
    return main(["draft", "train", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(out),
                 "--num-prompts", "2", "--num-samples", "2", "--max-new-tokens", "4", "--epochs", "1",
                 "--batch-size", "4", *flags])


def test_draft_train_refuses_a_used_out_and_overwrite_moves_it_aside_and_resume_trains_further(
        model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in ("1234", "abc5")))
    out = tmp_path / "draft"
    out.mkdir()
    (out / "draft_config.json").write_text("{}")
    assert draft_train(model_dir, prompts, out) == 2
    assert "--out '" in capsys.readouterr().err and (out / "draft_config.json").read_text() == "{}"
    assert draft_train(model_dir, prompts, out, "--overwrite") == 0
    (aside,) = tmp_path.glob("draft.previous-*")
    assert (aside / "draft_config.json").read_text() == "{}"
    first = (out / "draft.safetensors").read_bytes()
    assert draft_train(model_dir, prompts, out, "--resume") == 0
    assert "--resume: training the draft in" in capsys.readouterr().out
    assert (out / "draft.safetensors").read_bytes() != first


def test_draft_train_checks_out_before_any_work(model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "12"}\n')
    (tmp_path / "file").write_text("x")
    before = sorted(p.name for p in model_dir.iterdir())
    for out, message in [(tmp_path / "file", "is a file, not a folder"), (model_dir, "is --model"),
                         (tmp_path, "holds --prompts")]:
        assert draft_train(model_dir, prompts, out, "--overwrite") == 2
        assert message in capsys.readouterr().err
    assert sorted(p.name for p in model_dir.iterdir()) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("command", [["draft", "train", "--out", "OUT"], ["profile"]])
def test_a_cuda_device_without_cuda_is_one_line(model_dir, tmp_path, capsys, command):
    command = [str(tmp_path / "d") if arg == "OUT" else arg for arg in command]
    assert main([*command, "--model", str(model_dir), "--device", "cuda"]) == 2
    assert capsys.readouterr().err.strip() == ("turbogrpo: error: --device: 'cuda' needs CUDA, which this machine "
                                               "(or this torch build) lacks; use \"cpu\"")


def test_draft_train_with_a_config_renders_its_prompts_as_training_does(model_dir, tmp_path, monkeypatch):
    from turbogrpo.config import load_config
    from turbogrpo.models import load_model_and_tokenizer
    from turbogrpo.commands import draft_build as build
    from turbogrpo.data.prompt_sets import load_train_prompts

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"question": q}) + "\n" for q in ("12", "345", "6")))
    config_file = tmp_path / "run.toml"
    config_file.write_text(f'[model]\npath = "{model_dir}"\n[data]\nkind = "rows"\npath = "{rows}"\n'
                           'prompt_column = "question"\nsystem_prompt = "99"\nchat_template = "never"\n')
    seen = {}

    def train_on_own_completions(model, draft, prompts, stop_token_ids, recipe, **kwargs):
        seen["prompts"] = [p.tolist() for p in prompts]
        seen["num_draft_tokens"] = draft.config.num_draft_tokens

    monkeypatch.setattr(build, "train_on_own_completions", train_on_own_completions)
    assert main(["draft", "train", "--config", str(config_file), "--out", str(tmp_path / "d"), "--num-prompts", "2",
                 "--draft-tokens", "8"]) == 0  # the model is the config's
    _, tokenizer = load_model_and_tokenizer(model_dir)
    config = load_config(config_file)
    expected = load_train_prompts(config.data, tokenizer, seed=config.train.seed,
                                  max_new_tokens=config.rollout.max_new_tokens).examples[:2]
    assert seen == {"prompts": [ex.token_ids.tolist() for ex in expected], "num_draft_tokens": 8}


@pytest.mark.parametrize("flags, message", [
    (["--max-tokens", "1000000"], r"--max-tokens = 1000000 with --context-length = 8 needs about .* GiB free; use "
                                  r"--max-tokens \d+ or less"),
    (["--context-length", "100000"], r"--context-length = 100000 is past this model's positions"),
])
def test_profile_sizes_past_the_model_or_the_machine_are_one_line(model_dir, tmp_path, monkeypatch, capsys, flags,
                                                                  message):
    import re
    from turbogrpo.speculative import profiler
    monkeypatch.setenv("TURBOGRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(profiler, "free_memory_bytes", lambda model: 1 << 30)  # a 1 GiB machine, whatever runs this
    assert main(["profile", "--model", str(model_dir), "--context-length", "8", *flags]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("turbogrpo: error")]
    assert len(errors) == 1 and re.search(message, errors[0]) and not (tmp_path / "cache").exists()


def test_draft_train_eagle_layout_then_export_vllm(model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in ("1234", "abc5", "zz9")))
    drafts = {}
    for layout in ("eagle", "turbogrpo"):
        drafts[layout] = tmp_path / layout
        assert main(["draft", "train", "--model", str(model_dir), "--prompts", str(prompts), "--out",
                     str(drafts[layout]), "--num-samples", "2", "--max-new-tokens", "6", "--epochs", "1",
                     "--layout", layout]) == 0
    out = tmp_path / "vllm"
    assert main(["draft", "export-vllm", "--model", str(model_dir), "--draft", str(drafts["eagle"]),
                 "--out", str(out)]) == 0
    assert '"method": "eagle"' in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert "fc.weight" in load_file(out / "model.safetensors")
    assert main(["draft", "export-vllm", "--model", str(model_dir), "--draft", str(drafts["turbogrpo"]),
                 "--out", str(tmp_path / "refused")]) == 2
    assert "its layout 'turbogrpo' is not vLLM's EAGLE" in capsys.readouterr().err


def test_draft_train_eagle3_with_training_time_test_reports_acceptance_by_depth(model_dir, tmp_path, monkeypatch,
                                                                                capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in ("1234", "abc5", "zz9", "0x")))
    out = tmp_path / "eagle3"
    assert main(["draft", "train", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(out),
                 "--num-samples", "2", "--max-new-tokens", "6", "--epochs", "1", "--layout", "eagle3",
                 "--ttt-steps", "2", "--init-from-policy", "--validation-prompts", "1"]) == 0
    printed = capsys.readouterr().out
    assert "held-out acceptance at T = 1" in printed and "tokens per verification of one chain" in printed
    from turbogrpo.models import load_model_and_tokenizer
    policy, _ = load_model_and_tokenizer(model_dir)
    assert DraftHead.load(out, policy).config.feature_layers == (0, 1)
    monkeypatch.setenv("TURBOGRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TURBOGRPO_CACHE_DIR", raising=False)
    assert main(["profile", "--model", str(model_dir), "--draft", str(out), "--context-length", "8",
                 "--max-tokens", "2"]) == 0
    capsys.readouterr()
    assert main(["draft", "export-vllm", "--model", str(model_dir), "--draft", str(out),
                 "--out", str(tmp_path / "refused")]) == 2
    error = capsys.readouterr().err
    error_line = error.strip().splitlines()[-1]  # after the weight-loading bar
    assert error_line.startswith("turbogrpo: error: cannot export") and "layout 'eagle3' reduces" in error_line


def test_draft_train_and_profile_on_the_shipped_hybrid(tmp_path, monkeypatch, capsys):
    """`turbogrpo draft train --model demo-hybrid` (`draft build` knows recipes of packaged drafts only): the draft's
    body is Llama layers of the hybrid's width, its init names what the hybrid's layers cannot give it, and the
    rollout's held-out chains are reported; `profile` times the hybrid's steps and the draft's levels."""
    out = tmp_path / "draft"
    with pytest.warns(UserWarning, match=r"nothing of the same kind and shape for .*input_layernorm.weight"):
        assert main(["draft", "train", "--model", "demo-hybrid", "--out", str(out), "--num-prompts", "4",
                     "--num-samples", "2", "--max-new-tokens", "8", "--epochs", "1", "--batch-size", "4",
                     "--init-from-policy", "--validation-prompts", "1"]) == 0
    printed = capsys.readouterr().out
    assert "draft saved to" in printed and "tokens per verification of one chain" in printed
    from turbogrpo.models import load_model_and_tokenizer
    policy, _ = load_model_and_tokenizer("demo-hybrid")
    assert type(DraftHead.load(out, policy).layers[0]).__name__ == "LlamaDecoderLayer"
    monkeypatch.setenv("TURBOGRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TURBOGRPO_CACHE_DIR", raising=False)
    assert main(["profile", "--model", "demo-hybrid", "--draft", str(out), "--context-length", "8",
                 "--max-tokens", "4"]) == 0
    assert "draft ms" in capsys.readouterr().out
