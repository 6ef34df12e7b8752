"""Seconds per GRPO step (rollout + update): turbogrpo's trainer vs TRL's GRPOTrainer (HF generate).

Both train the same model on the same prompts with the same settings: G completions per prompt at
temperature 1 (no top-k/top-p), the same maximum completion length, loss "dapo" with clip-higher
(0.2 / 0.28), beta 0 (no reference model), one optimizer step per rollout (num_iterations 1, all
completions in one forward/backward), AdamW, grad-norm clipping at 1, speculation off. TRL runs
offline from a local model folder with its default generation backend (transformers ``generate``
with each prompt repeated G times).

Shapes:
* prompt-heavy: the bench model of bench/prefix.py (Qwen2-style, hidden 512, 8 layers, intermediate
  1536, 8/2 heads, vocab 16384, random init, float32), 8 prompts x G=8, prompts of 512 tokens, up to
  128 new tokens (a random model rarely emits its end token, so completions run ~128 tokens);
* demo: the shipped demo model on the built-in arithmetic task, with the demo's step shape;
* smollm2-zero-shot / smollm2-few-shot: the real model SmolLM2-135M-Instruct (bench/real_model.py; TRL loads
  the same cached float32 folder), 8 GSM8K train questions per step rendered with its chat template
  (a one-line system prompt, or that plus 4 worked solutions) x G=8, up to 128 new tokens, both stopping at
  its end token, and a dense reward (completion length mod 7, so every group has spread).

The two trainers' steps are interleaved (harness.interleaved_medians): TRL's own training loop runs in
a helper thread and is released one optimizer step at a time; turbogrpo's step is ``grpo_step`` of
its loop. Each side's phase times are recorded per step (TRL's by timing its own methods).

    python bench/e2e.py            # prompt-heavy: 2 timed steps each; demo: 3 timed steps after 1 warm-up
    python bench/e2e.py --quick    # 1 timed step each, no warm-up
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved_medians, print_table, write_results  # noqa: E402
from prefix import BENCH_MODEL  # noqa: E402

from turbogrpo.config import load_config  # noqa: E402
from turbogrpo.data import demo_records  # noqa: E402
from turbogrpo.models import declared_tokenizer, demo_model_path  # noqa: E402
from turbogrpo.rewards import Reward, math_accuracy_reward  # noqa: E402
from turbogrpo.train import distributed, loop, setup  # noqa: E402
from turbogrpo.train.run import build_run  # noqa: E402
from turbogrpo.train.state import start  # noqa: E402

PHASES = ("rollout", "rewards", "logprobs", "update")
SETTINGS = {  # shared by both trainers
    "lr": 1e-5, "epsilon_low": 0.2, "epsilon_high": 0.28, "max_grad_norm": 1.0, "beta": 0.0, "loss": "dapo",
}


# --- the two shapes ------------------------------------------------------------------------------------


def distinct_word_share(prompts, completions, **columns):
    """A cheap reward with spread on random text: share of distinct words in the completion."""
    return [len(set(c.split())) / max(len(c.split()), 1) for c in completions]


def bench_shape(folder: Path) -> dict:
    """The bench model saved with a word-level tokenizer over its 16384 ids, and 64 prompts of 512 ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {"<eos>": 0, "<pad>": 1, **{f"w{i}": i for i in range(2, BENCH_MODEL["vocab_size"])}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**{**BENCH_MODEL, "max_position_embeddings": 1024},
                                         eos_token_id=0, pad_token_id=1, bos_token_id=None)).float()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    generator = torch.Generator().manual_seed(0)
    rows = [{"prompt": " ".join(f"w{int(t)}" for t in torch.randint(2, BENCH_MODEL["vocab_size"], (512,),
                                                                      generator=generator))}
            for _ in range(64)]
    return {"name": "prompt-heavy (bench model)", "model": str(folder), "rows": rows, "reward": distinct_word_share,
            "num_prompts": 8, "num_generations": 8, "max_new_tokens": 128}


def completion_length_mod_7(prompts, completions, **columns):
    """A dense reward with spread on any text, so no group is skipped for having no signal."""
    return [float(len(c) % 7) for c in completions]


def smollm2_shape(few_shot: bool) -> dict:
    from real_model import chat_prompt_texts, load_real_model, real_model_folder
    _, tokenizer = load_real_model()
    rows = [{"prompt": text} for text in chat_prompt_texts(tokenizer, 64, few_shot=few_shot, split="train",
                                                           offset=100)]
    return {"name": f"SmolLM2-135M GSM8K {'few-shot' if few_shot else 'zero-shot'}", "model": real_model_folder(),
            "rows": rows, "reward": completion_length_mod_7, "num_prompts": 8, "num_generations": 8,
            "max_new_tokens": 128,
            # The real model's whole few-shot step in one forward/backward (13.6k tokens x 30 layers) was
            # killed for memory beside TRL's trainer on a 24 GB machine; the shipped configs' budget fits.
            "micro_batch_tokens": 16384 if few_shot else 1_000_000}


def demo_shape(model: str | None = None) -> dict:
    demo = load_config(Path(__file__).resolve().parents[1] / "configs" / "demo.toml")
    rows = demo_records("train", 256, seed=0)
    return {"name": "demo task (demo model)", "model": model or str(demo_model_path()), "rows": rows,
            "reward": math_accuracy_reward(), "num_prompts": demo.train.prompts_per_step,
            "num_generations": demo.rollout.num_generations, "max_new_tokens": demo.rollout.max_new_tokens}


# --- turbogrpo -----------------------------------------------------------------------------------------


class TurboStepper:
    """One call = one ``grpo_step`` of turbogrpo's loop, built from a config like a user's."""

    def __init__(self, shape: dict, workdir: Path):
        import json
        rows_path = workdir / "rows.jsonl"
        rows_path.write_text("".join(json.dumps(r) + "\n" for r in shape["rows"]))
        config = load_config(None, [
            f'model.path="{shape["model"]}"', "data.kind=rows", f'data.path="{rows_path}"',
            "data.chat_template=never", "data.max_prompt_tokens=4096",
            f"rollout.num_generations={shape['num_generations']}", f"rollout.max_new_tokens={shape['max_new_tokens']}",
            f"train.prompts_per_step={shape['num_prompts']}",
            f"train.micro_batch_tokens={shape.get('micro_batch_tokens', 1_000_000)}",
            f"algo.loss={SETTINGS['loss']}", f"algo.beta={SETTINGS['beta']}",
            f"algo.epsilon_low={SETTINGS['epsilon_low']}", f"algo.epsilon_high={SETTINGS['epsilon_high']}",
            f"optim.lr={SETTINGS['lr']}", f"optim.max_grad_norm={SETTINGS['max_grad_norm']}",
            "train.num_steps=1000", f'train.output_dir="{workdir / "turbogrpo"}"', "log.tensorboard=false",
            "log.completions_every=0", "log.progress_bar=false"])
        reward = Reward("reward", shape["reward"], 1.0, 0.0)
        self.run = build_run(config, distributed.setup("cpu"), [reward])
        start(self.run, resume=False)
        self.step = 0
        self.records: list[dict] = []

    def __call__(self) -> None:
        metrics = loop.grpo_step(self.run, self.step)
        self.step += 1
        self.records.append(metrics)


# --- TRL -----------------------------------------------------------------------------------------------


class TrlStepper:
    """One call = one optimizer step of TRL's GRPOTrainer, whose own ``train()`` loop runs in a thread."""

    def __init__(self, shape: dict, workdir: Path, num_steps: int):
        from datasets import Dataset
        from transformers import AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        stepper = self
        self.go, self.done = threading.Semaphore(0), threading.Semaphore(0)
        self.records: list[dict] = []
        self.error: BaseException | None = None
        self._phase: dict[str, float] = {}

        class Gate(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                stepper.go.acquire()
                stepper._phase = {"start": time.perf_counter()}

            def on_step_end(self, args, state, control, **kwargs):
                phase = stepper._phase
                phase["total"] = time.perf_counter() - phase.pop("start")
                stepper.records.append(phase)
                stepper.done.release()

        num_completions = shape["num_prompts"] * shape["num_generations"]
        args = GRPOConfig(
            output_dir=str(workdir / "trl"), report_to="none", use_cpu=True, save_strategy="no", logging_steps=1,
            max_steps=num_steps, per_device_train_batch_size=num_completions, gradient_accumulation_steps=1,
            num_generations=shape["num_generations"], max_completion_length=shape["max_new_tokens"],
            temperature=1.0, top_p=1.0, top_k=0, num_iterations=1, steps_per_generation=1,
            loss_type=SETTINGS["loss"], beta=SETTINGS["beta"], epsilon=SETTINGS["epsilon_low"],
            epsilon_high=SETTINGS["epsilon_high"], learning_rate=SETTINGS["lr"], lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=SETTINGS["max_grad_norm"],
            disable_tqdm=True, seed=0, dataloader_num_workers=0)
        reward = shape["reward"]

        def reward_fn(prompts, completions, **kwargs):
            return reward(prompts, completions, **kwargs)

        reward_fn.__name__ = "reward"
        # The tokenizer exactly as turbogrpo loads it (TRL's default AutoProcessor would pick the model
        # type's tokenizer class, Qwen2Tokenizer, which mis-reads a custom tokenizer.json).
        tokenizer = declared_tokenizer(Path(shape["model"]), AutoTokenizer.from_pretrained(shape["model"]))
        tokenizer.padding_side = "left"
        self.trainer = GRPOTrainer(model=shape["model"], reward_funcs=[reward_fn], args=args,
                                   train_dataset=Dataset.from_list(shape["rows"]), processing_class=tokenizer,
                                   callbacks=[Gate()])
        self._time_method("_generate", "rollout")
        self._time_method("_calculate_rewards", "rewards")
        self._time_method("_generate_and_score_completions", "prepare")
        self.thread = threading.Thread(target=self._train, daemon=True)
        self.thread.start()

    def _time_method(self, name: str, phase: str) -> None:
        original = getattr(self.trainer, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._phase[phase] = self._phase.get(phase, 0.0) + time.perf_counter() - start

        setattr(self.trainer, name, timed)

    def _train(self) -> None:
        try:
            self.trainer.train()
        except BaseException as err:  # surfaced in the main thread
            self.error = err
            self.done.release()

    def __call__(self) -> None:
        self.go.release()
        self.done.acquire()
        if self.error is not None:
            raise RuntimeError("TRL's training loop failed") from self.error

    @staticmethod
    def phases(record: dict) -> dict[str, float]:
        """TRL's step split like ours: rollout (generate), rewards, logprobs (the rest of its generate-and-
        score: padding, old/ref log-probs when needed, advantages), update (loss forward/backward, clipping,
        optimizer step)."""
        return {"rollout": record["rollout"], "rewards": record["rewards"],
                "logprobs": record["prepare"] - record["rollout"] - record["rewards"],
                "update": record["total"] - record["prepare"]}


# --- the benchmark -------------------------------------------------------------------------------------


def bench(shape: dict, workdir: Path, repeats: int, warmup: int) -> dict:
    print(f"\n{shape['name']}: {shape['num_prompts']} prompts x G={shape['num_generations']}, "
          f"up to {shape['max_new_tokens']} new tokens ...", flush=True)
    ours = TurboStepper(shape, workdir)
    trl = TrlStepper(shape, workdir, num_steps=warmup + repeats)
    timings = interleaved_medians({"trl": trl, "turbogrpo": ours}, repeats=repeats, warmup=warmup)
    trl.thread.join(timeout=60)
    ours_phases = {p: statistics.median(r.get(f"time/{p}", 0.0) for r in ours.records[warmup:]) for p in PHASES}
    trl_phases = {p: statistics.median(TrlStepper.phases(r)[p] for r in trl.records[warmup:]) for p in PHASES}
    prompt_tokens = statistics.mean(len(e.token_ids) for e in ours.run.batches.examples)
    record = {
        "shape": shape["name"], "num_prompts": shape["num_prompts"], "num_generations": shape["num_generations"],
        "max_new_tokens": shape["max_new_tokens"], "mean_prompt_tokens": prompt_tokens,
        "mean_completion_tokens_turbogrpo": statistics.mean(r["completion_length/mean"] for r in ours.records),
        "warmup_steps": warmup, "timed_steps": repeats,
        "timings": timings, "phases_s": {"trl": trl_phases, "turbogrpo": ours_phases},
        "speedup": timings["trl"]["median_s"] / timings["turbogrpo"]["median_s"],
        "settings": SETTINGS,
    }
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 timed step per shape, no warm-up")
    parser.add_argument("--shapes", default="prompt-heavy,demo", help="comma-separated: prompt-heavy, demo, smollm2-zero-shot, smollm2-few-shot")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--demo-model", help="model folder for the demo shape (default: the shipped demo model)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # (timed steps, warm-up steps): a prompt-heavy TRL step takes minutes on 2 CPU cores.
    plan = {"prompt-heavy": (2, 0), "demo": (3, 1), "smollm2-zero-shot": (2, 1), "smollm2-few-shot": (2, 1)}
    if args.quick:
        plan = {key: (1, 0) for key in plan}
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    records = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        makers = {"prompt-heavy": lambda: bench_shape(tmp / "bench_model"), "demo": lambda: demo_shape(args.demo_model),
                  "smollm2-zero-shot": lambda: smollm2_shape(False), "smollm2-few-shot": lambda: smollm2_shape(True)}
        for i, key in enumerate(args.shapes.split(",")):
            workdir = tmp / f"run{i}"
            workdir.mkdir()
            records.append(bench(makers[key](), workdir, *plan[key]))

    rows = []
    for r in records:
        trl_s, ours_s = r["timings"]["trl"]["median_s"], r["timings"]["turbogrpo"]["median_s"]
        rows.append([r["shape"], f"{r['num_prompts']}x{r['num_generations']}", round(r["mean_prompt_tokens"]),
                     r["max_new_tokens"], trl_s, ours_s, r["speedup"]])
    print()
    print_table("Seconds per GRPO step (median; rollout + rewards + logprobs + update), CPU",
                ["shape", "prompts x G", "prompt tok", "max new", "TRL s", "turbogrpo s", "speedup"], rows)
    phase_rows = []
    for r in records:
        for name in ("trl", "turbogrpo"):
            phases = r["phases_s"][name]
            phase_rows.append([r["shape"], name, *(phases[p] for p in PHASES)])
    print_table("Phase breakdown (median seconds per step)", ["shape", "trainer", *PHASES], phase_rows)
    load = {"before": load_before, "after": os.getloadavg()}
    print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']} on {os.cpu_count()} cores")
    write_results("e2e" if args.shapes == "prompt-heavy,demo" else "e2e_" + args.shapes.replace(",", "_"), {"shapes": records,
                          "torch_threads": torch.get_num_threads(), "load_average": load,
                          "note": "2 CPU cores shared with other processes: a load average above 2 means "
                                  "the two trainers competed with other work (alike, as steps alternate)"})


if __name__ == "__main__":
    main()
