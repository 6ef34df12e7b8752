"""Command-line pieces of speculation, wired into ``turbogrpo`` by ``add_commands``:

    turbogrpo draft train --out DIR [--model demo|PATH] [--prompts FILE | --config FILE | --task arithmetic]
                          [--resume | --overwrite]
        sample the policy's own completions, train a draft head on them, save it to DIR (a new or empty
        folder; --overwrite moves what is there aside, --resume trains the draft saved there further);
        --config renders the prompts of a training config's [data] section as training does
    turbogrpo draft export-vllm --draft DIR --out DIR [--model demo|PATH]
        write a draft (layout "eagle") as the folder vLLM's EAGLE speculative decoding loads
        (``speculative/export_vllm.py``); a draft vLLM would run differently is refused, naming why
    turbogrpo draft build --model smollm2 [--refresh]
        train the model's draft once by its recipe (``commands/draft_build.py``) into the cache beside the
        model; configs then name it (draft.path = "smollm2-gsm8k")
    turbogrpo profile [--model demo|PATH] [--draft DIR] [--context-length N] [--max-tokens N] [--refresh]
        measure (or read from the cache) forward latency vs. tokens and print the knee C_peak; both sizes
        are bounded by the model's positions and the device's free memory

``python -m turbogrpo.commands.draft ...`` runs the same commands on their own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ARITHMETIC = "arithmetic"
DRAFT_LAYOUT_NAMES = ("turbogrpo", "eagle3", "eagle")  # speculative.draft.DRAFT_LAYOUTS (not imported: the CLI starts fast)


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Add ``draft`` and ``profile`` to a ``turbogrpo`` subparser set; each sets ``args.run``."""
    draft = commands.add_parser("draft", help="draft-head tools (speculative rollouts)")
    draft_commands = draft.add_subparsers(dest="draft_command", required=True)
    train = draft_commands.add_parser("train", help="train a draft head on the policy's own completions")
    _add_model_arguments(train, default=None)
    train.add_argument("--out", required=True, help="folder to write the draft to (draft.safetensors + config)")
    source = train.add_mutually_exclusive_group()
    source.add_argument("--prompts", help="prompt file (.jsonl/.parquet/saved dataset) with a 'prompt' column")
    source.add_argument("--config", help="a training config: its [data] prompts, rendered as training renders "
                                         "them (chat template, system prompt), and its model unless --model")
    source.add_argument("--task", choices=[ARITHMETIC], default=ARITHMETIC,
                        help="built-in prompts (default: the demo's arithmetic task)")
    train.add_argument("--num-prompts", type=int, default=128, help="prompts to sample completions for")
    train.add_argument("--num-samples", type=int, default=8, help="completions per prompt")
    train.add_argument("--max-new-tokens", type=int, default=64, help="longest completion")
    train.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (GRPO's is 1)")
    train.add_argument("--layers", type=int, default=1, help="decoder layers in the draft")
    train.add_argument("--draft-tokens", type=int, default=0,
                       help="draft vocabulary: the N most frequent tokens of the completions (0: all)")
    train.add_argument("--layout", choices=sorted(DRAFT_LAYOUT_NAMES), default="turbogrpo",
                       help="draft layout; \"eagle3\" reads a low, a middle and a high layer of the policy (train it "
                            "with --ttt-steps > 1); \"eagle\" is vLLM's EAGLE drafter exactly (`draft export-vllm`)")
    train.add_argument("--ttt-steps", type=int, default=1,
                       help="training-time test: unrolled steps on the draft's own predictions (1: teacher forcing)")
    train.add_argument("--init-from-policy", action="store_true",
                       help="start the draft's layer as a copy of the policy's last layer")
    train.add_argument("--validation-prompts", type=int, default=0,
                       help="prompts held out of training, for the acceptance-by-depth report")
    train.add_argument("--epochs", type=int, default=4, help="passes over the completions")
    train.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    train.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step")
    train.add_argument("--seed", type=int, default=0)
    existing = train.add_mutually_exclusive_group()
    existing.add_argument("--resume", action="store_true",
                          help="train the draft saved in --out further (its own --layers) and save it there")
    existing.add_argument("--overwrite", action="store_true",
                          help="start anew in a used --out, moving its files aside (nothing is deleted)")
    train.set_defaults(run=run_draft_train)

    export = draft_commands.add_parser("export-vllm", help="write a draft as the folder vLLM's EAGLE loads")
    _add_model_arguments(export)
    export.add_argument("--draft", required=True, help="a saved draft folder (layout \"eagle\")")
    export.add_argument("--out", required=True, help="folder to write config.json + model.safetensors to")
    export.set_defaults(run=run_draft_export_vllm)

    build = draft_commands.add_parser("build", help="train a model's draft once by its recipe, into the cache")
    _add_model_arguments(build, default="smollm2")
    build.add_argument("--refresh", action="store_true", help="train it again even if it is built")
    build.set_defaults(run=run_draft_build)

    profile = commands.add_parser("profile", help="forward latency vs. tokens on this device, and the knee C_peak")
    _add_model_arguments(profile)
    profile.add_argument("--draft", help="a saved draft folder, to profile its forward too")
    profile.add_argument("--context-length", type=int, default=256, help="tokens of context the forwards attend to")
    profile.add_argument("--max-tokens", type=int, default=512, help="largest token count measured")
    profile.add_argument("--refresh", action="store_true", help="measure again even if a cached profile exists")
    profile.set_defaults(run=run_profile)


def _add_model_arguments(cmd: argparse.ArgumentParser, default: str | None = "demo") -> None:
    cmd.add_argument("--model", default=default, help=f"model folder, Hub name, or 'demo' / 'demo-hybrid' (the shipped "
                                                      f"models); "
                                                      f"default {default or 'demo, or the --config model'}")
    cmd.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 or float64")
    cmd.add_argument("--device", default=None, help="e.g. cuda, cuda:1, cpu (default: cuda if available)")


def _device(args) -> torch.device:
    from turbogrpo.placement import resolve_device
    return resolve_device(args.device or "auto", key="--device")


def _load(args):
    from turbogrpo.models import DEMO_MODELS, load_demo_model, load_model_and_tokenizer, resolve_model_path

    device = _device(args)
    if args.model in DEMO_MODELS:
        return load_demo_model(args.model, dtype=args.dtype, device=device)
    return load_model_and_tokenizer(resolve_model_path(args.model), dtype=args.dtype, device=device)


def _inputs(args) -> dict[str, Path]:
    """The files and folders ``draft train`` reads, which its --out must keep apart from."""
    from turbogrpo.models import model_source

    sources = {"--prompts": args.prompts, "--config": args.config}
    return {"--model": model_source(args.model), **{k: Path(v) for k, v in sources.items() if v}}


def _recipe(args: argparse.Namespace):
    from turbogrpo.speculative.built_drafts import DraftRecipe

    return DraftRecipe(num_prompts=args.num_prompts, num_samples=args.num_samples,
                       max_new_tokens=args.max_new_tokens, temperature=args.temperature, num_layers=args.layers,
                       num_draft_tokens=args.draft_tokens, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                       seed=args.seed, layout=args.layout, ttt_steps=args.ttt_steps,
                       init_from_policy=args.init_from_policy, validation_prompts=args.validation_prompts)


def run_draft_train(args: argparse.Namespace) -> int:
    from turbogrpo.train.output_dir import claim_folder

    config = _training_config(args)
    _recipe(args).check()
    _device(args)
    out = Path(args.out).expanduser().resolve()
    # Claimed before any work: a used, locked or impossible --out fails at once, not after training.
    lock = claim_folder(out, "--out", _inputs(args), resume=args.resume, overwrite=args.overwrite)
    try:
        return _train_draft(args, out, config)
    finally:
        lock.close()


def _training_config(args: argparse.Namespace):
    """The --config training config (None without one); it names the model unless --model does."""
    from turbogrpo.config import load_config

    config = load_config(args.config) if args.config else None
    if args.model is None:
        args.model = config.model.path if config is not None else "demo"
    return config


def _prompts(args: argparse.Namespace, tokenizer, model, config) -> list[torch.Tensor]:
    """Token ids ``[P]`` of the first --num-prompts prompts: a training config's, rendered by the trainer's
    own ``load_train_prompts``; else a --prompts file's or the arithmetic task's, by ``build_prompts``."""
    from turbogrpo.data import build_prompts, demo_records, read_records
    from turbogrpo.data.prompt_sets import load_train_prompts
    from turbogrpo.train.setup import position_limit

    if config is not None:
        examples = load_train_prompts(config.data, tokenizer, seed=config.train.seed,
                                      max_new_tokens=config.rollout.max_new_tokens,
                                      max_positions=position_limit(model)).examples
    else:
        rows = read_records(args.prompts) if args.prompts else demo_records("train", args.num_prompts, seed=args.seed)
        examples = build_prompts(rows[:args.num_prompts], tokenizer).examples
    return [ex.token_ids for ex in examples[:args.num_prompts]]


def _train_draft(args: argparse.Namespace, out: Path, config) -> int:
    from turbogrpo.commands.draft_build import train_on_own_completions
    from turbogrpo.train.setup import stop_token_ids

    model, tokenizer = _load(args)
    draft = _draft_to_train(args, model, out)  # before sampling: a damaged draft in --out fails at once
    prompts = _prompts(args, tokenizer, model, config)
    train_on_own_completions(model, draft, prompts, stop_token_ids(model, tokenizer), _recipe(args))
    draft.save(out)
    print(f"draft saved to {out}")
    return 0


def run_draft_build(args: argparse.Namespace) -> int:
    from turbogrpo.commands.draft_build import build_draft
    from turbogrpo.speculative.built_drafts import built_draft_for_model

    built = built_draft_for_model(args.model)
    folder = build_draft(built, refresh=args.refresh, device=_device(args))
    print(f"draft {built.name!r}: {folder}\n  use it with draft.path = \"{built.name}\" (or --draft {built.name})")
    return 0


def _draft_to_train(args: argparse.Namespace, model, out: Path):
    """With --resume, the draft saved in ``out`` (when there is one); else a new one of --layers layers."""
    from turbogrpo.speculative.draft import CONFIG_FILE, DraftHead

    if args.resume and (out / CONFIG_FILE).is_file():
        draft = DraftHead.load(out, model)
        print(f"--resume: training the draft in {out} further ({draft.config.num_layers} layers)")
        return draft
    if args.resume:
        print(f"--resume: no draft in {out} yet; training a new one")
    from turbogrpo.commands.draft_build import new_draft

    return new_draft(model, _recipe(args))


def run_draft_export_vllm(args: argparse.Namespace) -> int:
    from turbogrpo.speculative.draft import DraftHead
    from turbogrpo.speculative.export_vllm import export_vllm_draft

    model, _ = _load(args)
    folder = export_vllm_draft(DraftHead.load(args.draft, model), Path(args.out).expanduser())
    print(f"vLLM EAGLE draft written to {folder}\n  use it with speculative_config={{\"method\": \"eagle\", "
          f"\"model\": \"{folder}\", \"num_speculative_tokens\": K}}")
    return 0


def run_profile(args: argparse.Namespace) -> int:
    from turbogrpo.speculative.draft import DraftHead
    from turbogrpo.speculative.profiler import cache_path, cached_profile, check_profile_size

    model, _ = _load(args)
    # Before any allocation: past the model's positions or the free memory, one line instead of an
    # allocator crash or a run that never ends.
    check_profile_size(model, context_length=args.context_length, max_tokens=args.max_tokens,
                       keys=("--context-length", "--max-tokens"))
    draft = DraftHead.load(args.draft, model) if args.draft else None
    profile = cached_profile(model, context_length=args.context_length, draft=draft, refresh=args.refresh,
                             max_tokens=args.max_tokens)
    print(f"profile {profile.key}  (cache: {cache_path()})")
    print(f"{'tokens':>8} {'verify ms':>10}" + (f" {'draft ms':>9}" if profile.draft else ""))
    for i, n in enumerate(profile.verify.num_tokens):
        line = f"{n:>8} {1e3 * profile.verify.seconds[i]:>10.2f}"
        if profile.draft:
            line += f" {1e3 * profile.draft.seconds[i]:>9.2f}"
        print(line)
    print(f"C_peak (knee) = {profile.c_peak} tokens")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="turbogrpo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ValueError as err:
        print(f"turbogrpo: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
