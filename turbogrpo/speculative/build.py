"""Drafts trained on the policy's own completions: the one training routine of ``turbogrpo draft train``
and ``turbogrpo draft build``, and the cache of built drafts.

    turbogrpo draft build --model smollm2      trains the SmolLM2 draft once (~48 min on 2 CPU cores) into
                                               <cache>/drafts/, beside the model cache; later calls reuse it
    [draft] path = "smollm2-gsm8k"             a training config names a built draft by its name

A built draft is named (``BUILT_DRAFTS``): its model, the training config whose [data] section renders
the prompts exactly as training renders them (chat template, system prompt), and a ``DraftRecipe``. Its
folder, ``<cache>/drafts/<name>-<key>``, is keyed by the recipe, the config file's text and the model's
fingerprint, and appears whole or not at all (built in a temporary folder, then renamed). The draft
holds only its own layers: the policy's embeddings and 49k-row LM head are shared, not copied (see
``draft.py``), so SmolLM2's is 17 MB (one decoder layer and the fusion), not the 113 MB more a copied
head would add. Built on this project's shared 2-core CPU (load average 5-7): 26 min sampling 512
completions (128k tokens), 8 min of features, 14 min of training; top-1 agreement with the policy 0.31
in the last epoch (0.17 in the first: more epochs would still help).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from turbogrpo.speculative.draft import CONFIG_FILE, WEIGHTS_FILE, DraftHead

BUILD_RECORD = "turbogrpo_draft_build.json"


@dataclass(frozen=True)
class DraftRecipe:
    """How a draft is trained offline on the policy's own completions."""

    num_prompts: int
    """Prompts to sample completions for (the first ones of the prompt source)."""
    num_samples: int
    """Completions per prompt (G)."""
    max_new_tokens: int
    """Longest completion; a completion also ends at the model's stop tokens."""
    epochs: int
    """Passes over the completions."""
    batch_size: int
    """Completions per optimizer step (whole groups)."""
    temperature: float = 1.0
    """Sampling temperature (GRPO samples at 1, so the draft learns the distribution it will meet)."""
    num_layers: int = 1
    """Decoder layers of the draft (EAGLE's 1)."""
    num_draft_tokens: int = 0
    """Draft vocabulary: the tokens most frequent in the sampled completions (``DraftHead``); 0: all."""
    lr: float = 1e-3
    """AdamW learning rate."""
    seed: int = 0
    """Sampling and shuffling seed."""

    def check(self) -> None:
        """ValueError naming the first bad field (as its ``--flag``)."""
        for name in ("num_prompts", "num_samples", "max_new_tokens", "num_layers", "epochs", "batch_size"):
            if getattr(self, name) < 1:
                flag = "layers" if name == "num_layers" else name.replace("_", "-")  # draft train's flag
                raise ValueError(f"--{flag} must be >= 1, got {getattr(self, name)}")
        if self.num_draft_tokens < 0:
            raise ValueError(f"--draft-tokens must be >= 0, got {self.num_draft_tokens}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")


@dataclass(frozen=True)
class BuiltDraft:
    """A draft that ``turbogrpo draft build`` makes for one model."""

    name: str
    """What a config's draft.path (or ``--draft``) calls it."""
    model: str
    """The model.path it is trained for (a packaged model's name)."""
    config: str
    """The training config (relative to the checkout) whose [data] section renders the prompts."""
    recipe: DraftRecipe


# GSM8K train prompts with the chat template and system prompt of configs/smollm2_gsm8k.toml, 4 samples
# each at temperature 1 up to 320 tokens (~110k tokens: ~30 min of sampling, features and 2 epochs on
# 2 CPU cores; the draft learns the step-by-step style, which the capped tail adds little to).
BUILT_DRAFTS: dict[str, BuiltDraft] = {
    "smollm2-gsm8k": BuiltDraft("smollm2-gsm8k", "smollm2-135m-instruct", "configs/smollm2_gsm8k.toml",
                                DraftRecipe(num_prompts=128, num_samples=4, max_new_tokens=320, epochs=2,
                                            batch_size=8, num_draft_tokens=4096)),
}


def same_model(name: str, model_path: str) -> bool:
    """Whether a config's ``model_path`` names packaged model ``name`` (itself or an alias)."""
    from turbogrpo.gguf_models import PACKAGED_MODEL_ALIASES

    return PACKAGED_MODEL_ALIASES.get(model_path, model_path) == name


def built_draft_for_model(model: str) -> BuiltDraft:
    """The built draft of ``model`` (a packaged model's name or alias); ValueError naming those there are."""
    for built in BUILT_DRAFTS.values():
        if same_model(built.model, model):
            return built
    raise ValueError(f"no draft recipe for model {model!r}; `turbogrpo draft build` knows "
                     f"{sorted({b.model for b in BUILT_DRAFTS.values()})} (use `turbogrpo draft train` for others)")


def _checkout_path(path: str) -> Path:
    """``path`` as given when it exists from here, else relative to the checkout holding turbogrpo."""
    given = Path(path)
    return given if given.exists() else Path(__file__).resolve().parents[2] / path


def built_draft_folder(built: BuiltDraft, *, cache: Path | None = None) -> Path:
    """Where ``built`` lives: ``<cache>/drafts/<name>-<key>``, the key hashing its recipe, its config
    file's text and its model's fingerprint (so changing any of them builds anew)."""
    from turbogrpo.gguf_models import cache_root, gguf_source_file, _fingerprint

    config_path = _checkout_path(built.config)
    if not config_path.is_file():
        raise ValueError(f"draft {built.name!r} renders its prompts with {built.config}, which is not here; run "
                         "from the turbogrpo checkout")
    digest = hashlib.sha256(json.dumps({"model": _fingerprint(gguf_source_file(built.model)),
                                        "recipe": asdict(built.recipe), "config": config_path.read_text()},
                                       sort_keys=True).encode())
    return (cache or cache_root()) / "drafts" / f"{built.name}-{digest.hexdigest()[:12]}"


def is_built(folder: Path) -> bool:
    return all((folder / name).is_file() for name in (CONFIG_FILE, WEIGHTS_FILE, BUILD_RECORD))


def resolve_draft_path(path: str) -> str:
    """A draft.path as a folder: a built draft's name (``BUILT_DRAFTS``) becomes its cache folder (a
    ValueError saying how to build it when it is not built yet); anything else is returned as is."""
    if path not in BUILT_DRAFTS:
        return path
    built = BUILT_DRAFTS[path]
    folder = built_draft_folder(built)
    if not is_built(folder):
        raise ValueError(f"draft {path!r} is not built yet; build it once with `turbogrpo draft build --model "
                         f"{built.model}` (about 45 minutes on 2 CPU cores)")
    return str(folder)


def build_draft(built: BuiltDraft, *, refresh: bool = False, device: torch.device | None = None,
                log: Callable[[str], None] = print) -> Path:
    """The folder of ``built``, training it first unless it is already built (``refresh``: train anew)."""
    from turbogrpo.config import load_config
    from turbogrpo.files import write_folder_atomically
    from turbogrpo.models import load_model_and_tokenizer, resolve_model_path
    from turbogrpo.train.setup import load_train_prompts, position_limit, stop_token_ids

    folder = built_draft_folder(built)
    if is_built(folder) and not refresh:
        log(f"draft {built.name!r} is built: {folder}")
        return folder
    config = load_config(_checkout_path(built.config))
    model, tokenizer = load_model_and_tokenizer(resolve_model_path(built.model), device=device or "cpu")
    examples = load_train_prompts(config, tokenizer, position_limit(model)).examples
    prompts = [ex.token_ids for ex in examples[:built.recipe.num_prompts]]

    def write(tmp: Path) -> None:
        draft = DraftHead(model, num_layers=built.recipe.num_layers, num_draft_tokens=built.recipe.num_draft_tokens)
        record = train_on_own_completions(model, draft, prompts, stop_token_ids(model, tokenizer), built.recipe,
                                          log=log)
        draft.save(tmp)
        (tmp / BUILD_RECORD).write_text(json.dumps({"name": built.name, "model": built.model, "config": built.config,
                                                    "recipe": asdict(built.recipe), **record}, indent=1))

    log(f"building draft {built.name!r} into {folder}")
    return write_folder_atomically(folder, write, f"draft {built.name!r}")


def train_on_own_completions(model: nn.Module, draft: DraftHead, prompts: Sequence[torch.Tensor],
                             stop_token_ids: Sequence[int], recipe: DraftRecipe, *,
                             log: Callable[[str], None] = print) -> dict:
    """Sample ``recipe.num_samples`` completions of each prompt (token ids ``[P]``) from ``model``, then
    train ``draft`` on the model's features of them. Returns what was done: counts, seconds per phase,
    and the final loss and top-1 agreement with the policy (mean over the last epoch's steps)."""
    from tqdm import tqdm

    from turbogrpo.config import DraftLearningConfig
    from turbogrpo.rollout import SamplingConfig, generate
    from turbogrpo.speculative.draft_training import draft_groups, train_draft

    recipe.check()
    if not prompts:
        raise ValueError("no usable prompts (all empty or too long)")
    sampling = SamplingConfig(max_new_tokens=recipe.max_new_tokens, temperature=recipe.temperature,
                              stop_token_ids=tuple(stop_token_ids))
    start = time.perf_counter()
    completions: list[list[torch.Tensor]] = []
    chunk = max(1, 64 // recipe.num_samples)  # ~64 sequences per rollout keeps memory flat
    for first in tqdm(range(0, len(prompts), chunk), desc="sampling completions", unit="rollout"):
        rollout = generate(model, list(prompts[first:first + chunk]), num_samples=recipe.num_samples,
                           sampling=sampling, seed=recipe.seed + first)
        completions.extend(rollout.tokens_per_group())
    sampled = time.perf_counter()
    groups = draft_groups(model, prompts, completions)
    featured = time.perf_counter()
    num_completions = sum(len(g.completions) for g in groups)
    num_tokens = sum(len(c) for g in groups for c in g.completions)
    log(f"{num_completions} completions ({num_tokens} tokens) sampled in {sampled - start:.0f}s, "
        f"features in {featured - sampled:.0f}s")
    coverage = None
    if draft.config.num_draft_tokens:
        tokens = torch.cat([c for g in groups for c in g.completions]).cpu()
        coverage = choose_draft_tokens(draft, tokens)
        log(f"draft vocabulary: the {draft.config.num_draft_tokens} most frequent tokens cover {coverage:.1%} of "
            "the completions' tokens")
    config = DraftLearningConfig(lr=recipe.lr)
    num_steps = recipe.epochs * -(-num_completions // recipe.batch_size)  # about: batches hold whole groups
    with tqdm(total=num_steps, desc="training draft", unit="step") as bar:
        def on_step(step, metrics):
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", top1=f"{metrics['top1_agreement']:.2f}")
        history = train_draft(draft, groups, config, num_epochs=recipe.epochs, batch_size=recipe.batch_size,
                              seed=recipe.seed, on_step=on_step)
    trained = time.perf_counter()
    last_epoch = history[-max(1, len(history) // recipe.epochs):]
    record = {"num_prompts": len(groups), "num_completions": num_completions, "num_tokens": num_tokens,
              "num_draft_tokens": draft.config.num_draft_tokens, "draft_token_coverage": coverage,
              "sampling_s": round(sampled - start, 1), "features_s": round(featured - sampled, 1),
              "training_s": round(trained - featured, 1), "num_steps": len(history),
              "final_loss": sum(m["loss"] for m in last_epoch) / len(last_epoch),
              "final_top1_agreement": sum(m["top1_agreement"] for m in last_epoch) / len(last_epoch),
              "top1_agreement_per_epoch": [
                  sum(m["top1_agreement"] for m in history[e * len(history) // recipe.epochs:
                                                            (e + 1) * len(history) // recipe.epochs])
                  / max(1, len(history) // recipe.epochs) for e in range(recipe.epochs)]}
    log(f"draft trained in {record['training_s']:.0f}s: loss {record['final_loss']:.3f}, top-1 agreement with the "
        f"policy {record['final_top1_agreement']:.2f} (last epoch)")
    return record


def choose_draft_tokens(draft: DraftHead, tokens: torch.Tensor) -> float:
    """Make the ``draft.config.num_draft_tokens`` most frequent of ``tokens`` ``[T]`` (long) the draft's
    vocabulary (ties and unseen tokens by id); returns the share of ``tokens`` it covers."""
    counts_V = torch.bincount(tokens, minlength=draft.config.vocab_size).double()
    # Stable order: frequency first, then the lower id (a tiny tie-break below one count).
    ranked_V = (counts_V - torch.arange(len(counts_V), dtype=torch.double) / (2 * len(counts_V))).argsort(descending=True)
    chosen = ranked_V[:draft.config.num_draft_tokens]
    draft.set_draft_tokens(chosen.sort().values.to(draft.draft_token_ids.device))
    return float(counts_V[chosen].sum() / max(1.0, float(counts_V.sum())))
