"""Seconds per GRPO step (rollout + update): turbogrpo's trainer vs TRL's GRPOTrainer (HF generate).

Both train the same model on the same prompts with the same settings: G completions per prompt at
temperature 1 (no top-k/top-p), the same maximum completion length, loss "dapo" with clip-higher
(0.2 / 0.28), beta 0 (no reference model), one optimizer step per rollout (num_iterations 1, all
completions in one forward/backward on the demo shape; on the prompt-heavy and real-model shapes TRL
accumulates over micro-batches of one group and turbogrpo over its token budget, to fit memory), AdamW, grad-norm clipping at 1, no activation checkpointing (TRL's default
turns it on: set off here so both do the same work), speculation off. TRL runs
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
from harness import interleaved_medians, peak_rss_mb, print_table, reset_peak_rss, write_results  # noqa: E402
from prefix import BENCH_MODEL  # noqa: E402
from real_model import large_matmul_gflops  # noqa: E402

from turbogrpo.config import load_config  # noqa: E402
from turbogrpo.data import demo_records  # noqa: E402
from turbogrpo.models import declared_tokenizer, demo_model_path  # noqa: E402
from turbogrpo.placement import join_job  # noqa: E402
from turbogrpo.prefix.cost import ModelDims, layout_flops  # noqa: E402
from turbogrpo.rewards import Reward, math_accuracy_reward  # noqa: E402
from turbogrpo.train import loop, setup  # noqa: E402
from turbogrpo.train.run import build_run  # noqa: E402
from turbogrpo.train.output_dir import run_record  # noqa: E402
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
            "num_prompts": 8, "num_generations": 8, "max_new_tokens": 128,
            "trl_micro_batch": 8}  # 64 rows of 640 tokens in one TRL forward need ~32 GB even checkpointed


def completion_length_mod_7(prompts, completions, **columns):
    """A dense reward with spread on any text, so no group is skipped for having no signal. A completion is its
    text, or its messages (a conversational trainer's, such as TRL's AsyncGRPOTrainer): their contents joined."""
    texts = [c if isinstance(c, str) else "".join(m["content"] or "" for m in c) for c in completions]
    return [float(len(t) % 7) for t in texts]


SMOLLM2_QUESTIONS = {"num": 64, "split": "train", "offset": 100}
"""The GSM8K questions of the SmolLM2 shapes (``real_model.chat_messages`` arguments): train questions past the
few-shot examples, so no prompt holds its own worked solution."""


def smollm2_shape(few_shot: bool) -> dict:
    from real_model import chat_prompt_texts, load_real_model, real_model_folder
    _, tokenizer = load_real_model()
    rows = [{"prompt": text} for text in chat_prompt_texts(tokenizer, **SMOLLM2_QUESTIONS, few_shot=few_shot)]
    return {"name": f"SmolLM2-135M GSM8K {'few-shot' if few_shot else 'zero-shot'}", "model": real_model_folder(),
            "rows": rows, "reward": completion_length_mod_7, "num_prompts": 8, "num_generations": 8,
            "max_new_tokens": 128,
            # Micro-batches of about two zero-shot groups (one few-shot group): on this CPU packs of 2
            # groups ran 8 groups' forward+backward 1.11x faster than one pack of all 8 (the default
            # 8192-token budget; `bench/update.py --parts packs`), whose activations (8.2 GB transient)
            # leave the caches; the whole few-shot step in one pack (12.8k tokens) was killed for
            # memory beside TRL's trainer on 24 GB.
            "micro_batch_tokens": 2048,
            # TRL likewise runs one group (G completions) per forward/backward, accumulating over the K
            # groups into one optimizer step: all 64 padded completions at once do not fit either.
            "trl_micro_batch": 8}


def demo_shape(model: str | None = None) -> dict:
    demo = load_config(Path(__file__).resolve().parents[1] / "configs" / "demo.toml")
    rows = demo_records("train", 256, seed=0)
    return {"name": "demo task (demo model)", "model": model or str(demo_model_path()), "rows": rows,
            "reward": math_accuracy_reward(), "num_prompts": demo.train.prompts_per_step,
            "num_generations": demo.rollout.num_generations, "max_new_tokens": demo.rollout.max_new_tokens}


# --- turbogrpo -----------------------------------------------------------------------------------------


class TurboStepper:
    """One call = one ``grpo_step`` of turbogrpo's loop, built from a config like a user's."""

    def __init__(self, shape: dict, workdir: Path, overrides: tuple[str, ...] = ()):
        """``overrides``: more config settings (``key=value``, after the shape's), e.g. ``rollout.engine="vllm"``."""
        import json
        rows_path = workdir / "rows.jsonl"
        rows_path.write_text("".join(json.dumps(r) + "\n" for r in shape["rows"]))
        config = load_config(None, [
            f'model.path="{shape["model"]}"', f'model.dtype="{shape.get("dtype", "float32")}"', "data.kind=rows",
            f'data.path="{rows_path}"',
            "data.chat_template=never", "data.max_prompt_tokens=4096",
            f"rollout.num_generations={shape['num_generations']}", f"rollout.max_new_tokens={shape['max_new_tokens']}",
            f"train.prompts_per_step={shape['num_prompts']}",
            f"train.micro_batch_tokens={shape.get('micro_batch_tokens', 1_000_000)}",
            f"algo.loss={SETTINGS['loss']}", f"algo.beta={SETTINGS['beta']}",
            f"algo.epsilon_low={SETTINGS['epsilon_low']}", f"algo.epsilon_high={SETTINGS['epsilon_high']}",
            f"optim.lr={SETTINGS['lr']}", f"optim.max_grad_norm={SETTINGS['max_grad_norm']}",
            "train.num_steps=1000", f'train.output_dir="{workdir / "turbogrpo"}"', "log.tensorboard=false",
            "log.completions_every=0", "log.progress_bar=false", *overrides])
        reward = Reward("reward", shape["reward"], 1.0, 0.0)
        self.run = build_run(config, join_job("cpu"), [reward], run_record(config))
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

    def __init__(self, shape: dict, workdir: Path, num_steps: int, *, tokenizer=None, trainer_kwargs: dict | None = None,
                 config_overrides: dict | None = None):
        """``tokenizer`` (default: the model folder's, as turbogrpo loads it), ``trainer_kwargs`` (more
        ``GRPOTrainer`` arguments, e.g. ``environment_factory``) and ``config_overrides`` (``GRPOConfig`` fields)
        adapt it to other tasks (bench/multiturn.py)."""
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
                # This step's mean completion length (TRL logs and clears its metrics after this callback).
                lengths = stepper.trainer._metrics["train"].get("completions/mean_length") or [float("nan")]
                phase["completion_tokens_mean"] = lengths[-1]
                stepper.records.append(phase)
                stepper.done.release()

        num_completions = shape["num_prompts"] * shape["num_generations"]
        micro_batch = shape.get("trl_micro_batch", num_completions)
        if num_completions % micro_batch:
            raise ValueError(f"trl_micro_batch {micro_batch} must divide the step's {num_completions} completions")
        accumulation = num_completions // micro_batch
        args = GRPOConfig(
            output_dir=str(workdir / "trl"), report_to="none", use_cpu=True, save_strategy="no", logging_steps=1,
            max_steps=num_steps, per_device_train_batch_size=micro_batch, gradient_accumulation_steps=accumulation,
            steps_per_generation=accumulation,  # one rollout of all completions per optimizer step, as ours
            gradient_checkpointing=False,  # TRL's default recomputes activations; turbogrpo's run does not
            num_generations=shape["num_generations"], max_completion_length=shape["max_new_tokens"],
            temperature=shape.get("temperature", 1.0), top_p=1.0, top_k=0, num_iterations=1,
            loss_type=SETTINGS["loss"], beta=SETTINGS["beta"], epsilon=SETTINGS["epsilon_low"],
            epsilon_high=SETTINGS["epsilon_high"], learning_rate=SETTINGS["lr"], lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=SETTINGS["max_grad_norm"],
            disable_tqdm=True, seed=0, dataloader_num_workers=0,
            bf16=shape.get("dtype") == "bfloat16",  # accelerate's autocast, as ours: float32 masters, bf16 compute
            **(config_overrides or {}))
        reward = shape["reward"]

        def reward_fn(prompts, completions, **kwargs):
            return reward(prompts, completions, **kwargs)

        reward_fn.__name__ = "reward"
        # The tokenizer exactly as turbogrpo loads it (TRL's default AutoProcessor would pick the model
        # type's tokenizer class, Qwen2Tokenizer, which mis-reads a custom tokenizer.json).
        if tokenizer is None:
            tokenizer = declared_tokenizer(Path(shape["model"]), AutoTokenizer.from_pretrained(shape["model"]))
        tokenizer.padding_side = "left"
        self.trainer = GRPOTrainer(model=shape["model"], reward_funcs=[reward_fn], args=args,
                                   train_dataset=Dataset.from_list(shape["rows"]), processing_class=tokenizer,
                                   callbacks=[Gate()], **(trainer_kwargs or {}))
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

    @staticmethod
    def median_phases(records: list[dict]) -> dict[str, float]:
        """Median seconds per phase (:meth:`phases`) over ``records``."""
        return {p: statistics.median(TrlStepper.phases(r)[p] for r in records) for p in PHASES}


# --- the benchmark -------------------------------------------------------------------------------------


class StepMemory:
    """Wraps a stepper: each call records the step's transient peak, the process's peak resident set
    during the step (Linux VmHWM, reset before it) minus the resident set it started from, in MB.

    Both trainers live in one process, so a step's absolute peak also holds the other trainer's model;
    the transient peak is what the step itself adds on top of what persists between steps (weights,
    gradients, optimizer state: see :func:`training_state_mb`)."""

    def __init__(self, step):
        self.step = step
        self.transient_mb: list[float] = []

    def __call__(self) -> None:
        before = reset_peak_rss()
        self.step()
        self.transient_mb.append(peak_rss_mb() - before)


def training_state_mb(model: torch.nn.Module) -> dict[str, float]:
    """Bytes that persist across steps for full fine-tuning with AdamW, from the parameter count:
    weights and gradients in the parameters' dtype, AdamW's two moments in float32."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.numel() * p.element_size() for p in trainable)
    adamw = sum(2 * p.numel() * 4 for p in trainable)
    return {"weights_mb": weights / 2 ** 20, "grads_mb": grads / 2 ** 20, "adamw_mb": adamw / 2 ** 20,
            "total_mb": (weights + grads + adamw) / 2 ** 20}


def update_gflops(ours: TurboStepper, records: list[dict], shape: dict, prompt_tokens: float, update_s: float) -> float:
    """The rate of turbogrpo's update: forward + backward = 3x the shared layout's forward FLOPs
    (prefix.cost.layout_flops) over its median update seconds. Lengths are the timed steps' means
    (mean prompt, mean completion, groups trained), exact for the weight matmuls, which are linear in
    tokens; attention's quadratic share is approximated."""
    groups = statistics.mean(r.get("frac_groups_trained", 1.0) for r in records) * shape["num_prompts"]
    completion = statistics.mean(r["completion_length/mean"] for r in records)
    dims = ModelDims.of(ours.run.policy)
    flops = layout_flops(dims, [round(prompt_tokens)], [[round(completion)] * shape["num_generations"]]).shared
    return 3 * flops * groups / update_s / 1e9


def bench(shape: dict, workdir: Path, repeats: int, warmup: int, *, trl_overrides: dict | None = None,
          turbo_overrides: tuple[str, ...] = ()) -> dict:
    """One shape, both trainers' steps interleaved. ``trl_overrides`` (``GRPOConfig`` fields) and
    ``turbo_overrides`` (config settings) adapt the two sides (bench/trl_vllm.py: TRL sampling with vLLM)."""
    print(f"\n{shape['name']}: {shape['num_prompts']} prompts x G={shape['num_generations']}, "
          f"up to {shape['max_new_tokens']} new tokens ...", flush=True)
    ours = TurboStepper(shape, workdir, turbo_overrides)
    trl = TrlStepper(shape, workdir, num_steps=warmup + repeats, config_overrides=trl_overrides)
    memory = {"trl": StepMemory(trl), "turbogrpo": StepMemory(ours)}
    timings = interleaved_medians(memory, repeats=repeats, warmup=warmup)
    trl.thread.join(timeout=60)
    ours_phases = {p: statistics.median(r.get(f"time/{p}", 0.0) for r in ours.records[warmup:]) for p in PHASES}
    trl_phases = TrlStepper.median_phases(trl.records[warmup:])
    prompt_tokens = statistics.mean(len(e.token_ids) for e in ours.run.batches.examples)
    update_rate = update_gflops(ours, ours.records[warmup:], shape, prompt_tokens, ours_phases["update"])
    large_rate = large_matmul_gflops(getattr(torch, shape.get("dtype", "float32")))
    record = {
        "shape": shape["name"], "dtype": shape.get("dtype", "float32"), "num_prompts": shape["num_prompts"], "num_generations": shape["num_generations"],
        "max_new_tokens": shape["max_new_tokens"], "mean_prompt_tokens": prompt_tokens,
        "mean_completion_tokens_turbogrpo": statistics.mean(r["completion_length/mean"] for r in ours.records),
        "warmup_steps": warmup, "timed_steps": repeats,
        "timings": timings, "phases_s": {"trl": trl_phases, "turbogrpo": ours_phases},
        "speedup": timings["trl"]["median_s"] / timings["turbogrpo"]["median_s"],
        "update_gflops": update_rate, "large_matmul_gflops": large_rate,
        "update_fraction_of_large_matmul": update_rate / large_rate,
        "memory_mb": {name: {"step_transient_peak": max(m.transient_mb[warmup:]),
                             **training_state_mb(ours.run.policy if name == "turbogrpo" else trl.trainer.model)}
                      for name, m in memory.items()},
        "settings": SETTINGS,
        "rollout_per_token": rollout_per_token(shape, ours.records[warmup:], trl.records[warmup:]),
    }
    return record


def rollout_per_token(shape: dict, ours: list[dict], trl: list[dict]) -> dict:
    """Each trainer's median rollout seconds per step over its mean completion tokens (the two sample different
    completions, which stop at different lengths), and its weight push: TRL's rollout phase includes its push,
    ours keeps it apart (``time/weight_push``)."""
    completions = shape["num_prompts"] * shape["num_generations"]
    ours_tokens = statistics.median(r["completion_length/mean"] for r in ours) * completions
    trl_tokens = statistics.median(r.get("completion_tokens_mean", float("nan")) for r in trl) * completions
    ours_push = statistics.median(r.get("time/weight_push", 0.0) for r in ours)
    ours_rollout = statistics.median(r["time/rollout"] for r in ours)
    trl_rollout = statistics.median(TrlStepper.phases(r)["rollout"] for r in trl)
    return {"turbogrpo": {"tokens": ours_tokens, "rollout_s": ours_rollout, "weight_push_s": ours_push,
                          "ms_per_token_with_push": 1e3 * (ours_rollout + ours_push) / ours_tokens},
            "trl": {"tokens": trl_tokens, "rollout_with_push_s": trl_rollout,
                    "ms_per_token_with_push": 1e3 * trl_rollout / trl_tokens}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 timed step per shape, no warm-up")
    parser.add_argument("--shapes", default="prompt-heavy,demo", help="comma-separated: prompt-heavy, demo, smollm2-zero-shot, smollm2-few-shot")
    parser.add_argument("--steps", type=int, help="timed steps per shape (default: the shape's plan)")
    parser.add_argument("--warmup", type=int, help="warm-up steps per shape (default: the shape's plan)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="compute dtype of both trainers (bfloat16: float32 masters under autocast, on both sides)")
    parser.add_argument("--demo-model", help="model folder for the demo shape (default: the shipped demo model)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # (timed steps, warm-up steps): a prompt-heavy TRL step takes minutes on 2 CPU cores.
    plan = {"prompt-heavy": (2, 0), "demo": (3, 1), "smollm2-zero-shot": (2, 1), "smollm2-few-shot": (2, 1)}
    if args.quick:
        plan = {key: (1, 0) for key in plan}
    plan = {key: (args.steps or steps, warmup if args.warmup is None else args.warmup)
            for key, (steps, warmup) in plan.items()}
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
            records.append(bench({**makers[key](), "dtype": args.dtype}, workdir, *plan[key]))

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
    print_table("turbogrpo's update rate (forward + backward GFLOP/s) against this process's large-matmul rate",
                ["shape", "update GFLOP/s", "large matmul GFLOP/s", "fraction"],
                [[r["shape"], r["update_gflops"], r["large_matmul_gflops"], r["update_fraction_of_large_matmul"]]
                 for r in records])
    memory_rows = [[r["shape"], name, m["step_transient_peak"], m["weights_mb"], m["grads_mb"], m["adamw_mb"],
                    m["total_mb"]] for r in records for name, m in r["memory_mb"].items()]
    print_table("Memory (MB): a step's transient peak (measured) next to what persists between steps",
                ["shape", "trainer", "step peak", "weights", "grads", "AdamW", "persistent"], memory_rows)
    load = {"before": load_before, "after": os.getloadavg()}
    print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']} on {os.cpu_count()} cores")
    name = "e2e" if args.shapes == "prompt-heavy,demo" else "e2e_" + args.shapes.replace(",", "_")
    write_results(name + ("_bf16" if args.dtype == "bfloat16" else ""), {"shapes": records, "dtype": args.dtype,
                          "torch_threads": torch.get_num_threads(), "load_average": load,
                          "note": "2 CPU cores shared with other processes: a load average above 2 means "
                                  "the two trainers competed with other work (alike, as steps alternate)"})


if __name__ == "__main__":
    main()
