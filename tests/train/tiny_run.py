"""A tiny model folder, prompt rows and reward functions for end-to-end trainer tests."""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from turbogrpo.models import tiny_model

CHARS = string.ascii_letters + string.digits + " .,:;?!+-=#\n"
SPECIALS = ["<eos>", "<pad>", "<unk>"]


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (vocab 79): small enough for test models, exact round trips."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")


def write_model(folder: Path, seed: int = 0, build=None, **config_overrides) -> Path:
    """A tiny model and the character tokenizer in ``folder``: a qwen2, or ``build(vocab_size=...)``'s model."""
    tokenizer = char_tokenizer()
    model = (build(vocab_size=len(tokenizer)) if build is not None else
             tiny_model("qwen2", vocab_size=len(tokenizer), hidden=32, layers=2, heads=4, kv_heads=2, seed=seed,
                        **config_overrides))
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_rows(path: Path, num: int = 24) -> Path:
    rows = [{"prompt": f"Count to {i % 7 + 2}:", "answer": str(i % 7 + 2)} for i in range(num)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def digit_share(prompts, completions, **columns):
    """Share of a completion's characters that are digits (a reward a tiny model can learn fast)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def flaky(prompts, completions, **columns):
    """Raises on every other call and returns None for the first item otherwise."""
    flaky.calls = getattr(flaky, "calls", 0) + 1
    if flaky.calls % 2:
        raise RuntimeError("reward service unavailable")
    return [None] + [1.0] * (len(completions) - 1)


def chatty(prompts, completions, **columns):
    """Raises with a message of 1.4 MB (a reward service that returns its whole response as the error)."""
    raise RuntimeError("detail " * 200_000)


def overflowing(prompts, completions, **columns):
    """+-3e38 in turn: finite in float32, but a group's std of them is inf."""
    return [3e38 if i % 2 else -3e38 for i in range(len(completions))]


def overrides(model_dir: Path, rows: Path, output_dir: Path, **extra) -> list[str]:
    """--set overrides of a tiny, fast, deterministic run."""
    base = {
        "model.path": f'"{model_dir}"', "data.kind": "rows", "data.path": f'"{rows}"', "data.eval_path": f'"{rows}"',
        "data.num_eval_problems": 8, "rewards.0.function": "tests.train.tiny_run:digit_share",
        "train.accuracy_reward": "math_accuracy", "rollout.num_generations": 4, "rollout.max_new_tokens": 6,
        "train.prompts_per_step": 4, "train.num_steps": 4, "train.micro_batch_tokens": 64,
        "train.output_dir": f'"{output_dir}"', "train.checkpoint_every": 2, "optim.lr": 3e-3,
        "log.tensorboard": "false", "log.progress_bar": "false", "log.completions_every": 2,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]
