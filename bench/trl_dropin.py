"""TRL's GRPOTrainer with and without turbogrpo's drop-in (turbogrpo.integrations.trl).

Two measurements, each interleaved run by run between the two trainers in one process:

* training forward+backward: TRL's ``_compute_loss`` and its backward on one generated batch (the
  policy's per-token log-probs with entropy, TRL's loss, gradients); the part the drop-in changes;
* one whole TRL step: ``trainer.training_step`` (TRL's generation with transformers ``generate``,
  rewards, advantages, loss, backward) plus the optimizer update.

Shape: 8 prompts x G=8 completions, 512-token prompts, 128 new tokens, one micro-batch of 64 rows
(per_device_train_batch_size=64, steps_per_generation=1). Model: the "bench model" of
bench/prefix.py (Qwen2-style, hidden 512, 8 layers, vocab 16384), random init, float32. TRL's
defaults otherwise (gradient checkpointing on, beta=0, loss_type "dapo"), except bf16=False: TRL
would autocast the float32 model to bfloat16, which is slow on CPU and which the drop-in hands back
to TRL (see the module doc of turbogrpo.integrations.trl).

    python bench/trl_dropin.py            # 3 repeats of fwd+bwd (after 1 warm-up), 2 of the whole step
    python bench/trl_dropin.py --quick    # 1 repeat each, no warm-up; writes trl_dropin_quick.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved_medians, print_table, write_results  # noqa: E402
from prefix import BENCH_MODEL  # noqa: E402

NUM_PROMPTS, GROUP, PROMPT_LEN, NEW_TOKENS = 8, 8, 512, 128
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer whose words ``t<i>`` are token ids ``i`` (ids 0 and 1: pad and eos)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   padding_side="left")


def prompt_rows(vocab_size: int, seed: int = 0) -> list[dict]:
    """A generation batch as TRL's sampler yields it: each prompt repeated G times in a row."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [" ".join(f"t{i}" for i in torch.randint(2, vocab_size, (PROMPT_LEN,), generator=gen).tolist())
               for _ in range(NUM_PROMPTS)]
    return [{"prompt": p} for p in prompts for _ in range(GROUP)]


def length_reward(completions, **_):
    """Any reward that differs within a group, so that advantages (and gradients) are not zero."""
    return [float(len(c) % 7) for c in completions]


def fixed_rollout(prompts, trainer):
    """Completions of exactly NEW_TOKENS random tokens without generating (TRL's rollout_func hook): for
    timing the training forward+backward alone, where the tokens do not matter."""
    gen = torch.Generator().manual_seed(1)
    prompt_ids = trainer.processing_class(prompts)["input_ids"]
    vocab_size = trainer.processing_class.vocab_size
    completions = torch.randint(2, vocab_size, (len(prompts), NEW_TOKENS), generator=gen).tolist()
    return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}


def build_trainer(model, tokenizer, output_dir: str, shared: bool, *, micro_batches: int, generate: bool, **config):
    """A GRPOTrainer (``shared``: with the drop-in) whose generation batch is the whole shape, trained in
    ``micro_batches`` gradient-accumulated micro-batches; without ``generate``, completions are random."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from turbogrpo.integrations.trl import SharedPrefixGRPOTrainer
    args = GRPOConfig(output_dir=output_dir, report_to="none", save_strategy="no", seed=0,
                      num_generations=GROUP, max_completion_length=NEW_TOKENS,
                      per_device_train_batch_size=NUM_PROMPTS * GROUP // micro_batches,
                      steps_per_generation=micro_batches, gradient_accumulation_steps=micro_batches, **config)
    trainer_class = SharedPrefixGRPOTrainer if shared else GRPOTrainer
    trainer = trainer_class(model=model, reward_funcs=[length_reward], args=args, processing_class=tokenizer,
                            train_dataset=Dataset.from_dict({"prompt": ["t2"]}),
                            rollout_func=None if generate else fixed_rollout)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = micro_batches  # set by Trainer.train
    trainer.create_optimizer()
    return trainer


def training_forward_backward(trainer, batch, micro_batches: int):
    """TRL's loss and backward over the generation batch in ``micro_batches`` runs of consecutive rows
    (whole groups: TRL's own split would first shuffle the rows; see the README)."""
    from trl.trainer.utils import split_tensor_dict
    micro = split_tensor_dict(batch, micro_batches)

    def run():
        trainer.model.zero_grad(set_to_none=True)
        for inputs in micro:
            trainer._compute_loss(trainer.model, inputs).backward()
    return run


def whole_step(trainer, rows):
    """One optimizer step as ``Trainer.train`` runs it: ``steps_per_generation`` calls of TRL's
    ``training_step`` (the first generates the whole batch, shuffles its rows and buffers the
    micro-batches; each call trains one), then the optimizer update."""
    def run():
        torch.manual_seed(0)  # the same completions for both trainers
        assert trainer._step % trainer.args.steps_per_generation == 0  # this step starts with a generation
        for _ in range(trainer.args.steps_per_generation):
            trainer.training_step(trainer.model, rows, None)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
    return run


def measure(make_model, tokenizer, *, repeats: int, step_repeats: int, warmup: int, budget_s: float | None = None,
            micro_batches: int = 1, report=None, **config) -> dict:
    """Interleaved medians for TRL and the drop-in: training fwd+bwd and one whole step.

    With ``budget_s``, repeats beyond the first are run only while the time measured so far says they
    fit, and the whole step is skipped (with the reason recorded) when even one would not.
    ``report(partial_result)`` is called once the fwd+bwd is measured, so a long run keeps it.
    With ``step_repeats=0`` nothing is generated (random completions) and the whole step is skipped.
    """
    started = time.perf_counter()
    rows = prompt_rows(tokenizer.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {name: build_trainer(make_model(), tokenizer, f"{tmp}/{name}", shared=name == "turbogrpo",
                                        micro_batches=micro_batches, generate=step_repeats > 0, **config)
                    for name in ("trl", "turbogrpo")}
        batches = {}
        generation_s = time.perf_counter()
        for name, trainer in trainers.items():
            torch.manual_seed(0)
            batches[name] = trainer._generate_and_score_completions(rows)
        generation_s = (time.perf_counter() - generation_s) / len(trainers)
        completion_tokens = int(batches["trl"]["completion_mask"].sum())

        def left_s() -> float:
            return float("inf") if budget_s is None else budget_s - (time.perf_counter() - started)

        def how_many(wanted: int, each_s: float, share: float = 1.0) -> int:
            """Repeats of ``each_s`` seconds, up to ``wanted``, that fit in ``share`` of the budget left."""
            return wanted if budget_s is None else min(wanted, int(share * left_s() / each_s))

        fns = {name: training_forward_backward(t, batches[name], micro_batches) for name, t in trainers.items()}
        fwd_bwd = interleaved_medians(fns, repeats=1, warmup=warmup)
        pair_s = sum(t["median_s"] for t in fwd_bwd.values())
        more = how_many(repeats - 1, pair_s, share=0.5)  # half the time left: the step needs the rest
        if more > 0:
            fwd_bwd = _merge(fwd_bwd, interleaved_medians(fns, repeats=more, warmup=0))
        fwd_bwd["speedup"] = fwd_bwd["trl"]["median_s"] / fwd_bwd["turbogrpo"]["median_s"]
        result = {"shape": {"num_prompts": NUM_PROMPTS, "group": GROUP, "prompt_len": PROMPT_LEN,
                            "new_tokens": NEW_TOKENS, "completion_tokens_in_batch": completion_tokens},
                  "trl_config": {**config, "micro_batches": micro_batches}, "generation_s": generation_s,
                  "forward_backward": fwd_bwd,
                  "whole_step": {"skipped": "not measured yet"}}
        if report is not None:
            report(result)
        step_pair_s = 2 * generation_s + pair_s  # generation dominates a step; fwd+bwd is measured above
        num_steps = how_many(step_repeats, step_pair_s)
        if step_repeats == 0:
            step = {"skipped": "not asked for (step_repeats=0)"}
        elif num_steps > 0:
            # No warm-up: the fwd+bwd runs above warmed both trainers, and a step costs minutes on CPU.
            step = interleaved_medians({name: whole_step(t, rows) for name, t in trainers.items()},
                                       repeats=num_steps, warmup=0)
            step["speedup"] = step["trl"]["median_s"] / step["turbogrpo"]["median_s"]
        else:
            step = {"skipped": f"a step pair takes about {step_pair_s:.0f}s; {left_s():.0f}s of the budget left"}
        stats = trainers["turbogrpo"].shared_prefix_stats
    return {**result, "whole_step": step,
            "drop_in_stats": {"shared_calls": stats.num_shared_calls, "fallback_calls": stats.num_fallback_calls,
                              "fallback_reasons": stats.fallback_reasons}}


def _merge(first: dict, second: dict) -> dict:
    """Two interleaved_medians results of the same callables, as one."""
    merged = {}
    for name in first:
        times = first[name]["times_s"] + second[name]["times_s"]
        merged[name] = {"median_s": statistics.median(times), "min_s": min(times), "times_s": times}
    return merged


def bench_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    config = Qwen2Config(**BENCH_MODEL, pad_token_id=0, eos_token_id=1)
    return Qwen2ForCausalLM(config).float()


def print_result(title: str, result: dict) -> None:
    rows = [[part, result[part]["trl"]["median_s"], result[part]["turbogrpo"]["median_s"], result[part]["speedup"]]
            if "skipped" not in result[part] else [part, "-", "-", result[part]["skipped"]]
            for part in ("forward_backward", "whole_step")]
    print_table(title, ["part", "TRL s", "TRL + turbogrpo s", "speedup"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 repeat each, no warm-up")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the fwd+bwd")
    parser.add_argument("--step-repeats", type=int, default=2,
                        help="interleaved repeats of the whole step (0: none, and no generation at all)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed fwd+bwd runs first")
    # TRL's fwd+bwd of all 64 rows at once peaks at about 32 GB here (4 GB per group of 8 rows).
    parser.add_argument("--micro-batches", type=int, default=NUM_PROMPTS,
                        help="gradient-accumulated micro-batches per step (default: one group each)")
    cli = parser.parse_args()
    repeats, step_repeats, warmup = (1, 1, 0) if cli.quick else (cli.repeats, cli.step_repeats, cli.warmup)
    tokenizer = word_tokenizer(BENCH_MODEL["vocab_size"])
    header = {"note": "2-core CPU, shared with other jobs; ratios come from runs interleaved in one process",
              "model": BENCH_MODEL, "dtype": "float32", "repeats": repeats, "step_repeats": step_repeats,
              "warmup": warmup, "step_warmup": 0}

    def write(result: dict) -> None:
        write_results("trl_dropin_quick" if cli.quick else "trl_dropin", {**header, **result})

    result = measure(bench_model, tokenizer, repeats=repeats, step_repeats=step_repeats, warmup=warmup,
                     micro_batches=cli.micro_batches, report=write, use_cpu=True, bf16=False)
    title = (f"TRL GRPOTrainer, bench model, {NUM_PROMPTS} prompts x G={GROUP}, {PROMPT_LEN}-token prompts, "
             f"{NEW_TOKENS} new tokens, CPU float32")
    print_result(title, result)
    write(result)


if __name__ == "__main__":
    main()
