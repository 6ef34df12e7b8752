"""The drafts ``turbogrpo draft build`` makes: their recipes (``BUILT_DRAFTS``), where each lives in the
cache, and how a config's draft.path names one. Training them is ``build.py``'s; this module imports
nothing of the trainer, so configs can check a draft.path against it.

A built draft is named: its model, the training config whose [data] section renders the prompts
exactly as training renders them (chat template, system prompt), and a ``DraftRecipe``. Its folder,
``<cache>/drafts/<name>-<key>``, is keyed by the recipe, the config file's text and the model's
fingerprint, and appears whole or not at all (built in a temporary folder, then renamed).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from turbogrpo.speculative.draft import CONFIG_FILE, DRAFT_LAYOUTS, WEIGHTS_FILE

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
    validation_prompts: int = 0
    """Groups held out of training (the last prompts'), on which each epoch's top-1 agreement and loss
    are measured, and at the end the acceptance by depth (``draft_unroll.acceptance_by_depth``)."""
    layout: str = "turbogrpo"
    """Draft layout (``draft.DRAFT_LAYOUTS``): "turbogrpo", "eagle3" or "eagle"."""
    ttt_steps: int = 1
    """Training-time test: unrolled steps on the draft's own predictions (1: teacher forcing alone)."""
    init_from_policy: bool = False
    """Start the draft's layer as a copy of the policy's last layer."""
    report_depth: int = 4
    """Depths the held-out acceptance report covers."""

    def key_fields(self) -> dict:
        """The fields that key a built draft's folder: all of them, but the ones added with "eagle3" only when
        they differ from their defaults, so that drafts built before them keep their folders."""
        fields = asdict(self)
        for name, default in LATER_FIELDS.items():
            if fields[name] == default:
                del fields[name]
        return fields

    def sampling(self) -> dict:
        """The fields that decide the sampled completions (a kept sample is reused while they agree)."""
        return {k: getattr(self, k) for k in ("num_prompts", "num_samples", "max_new_tokens", "temperature", "seed")}

    def check(self) -> None:
        """ValueError naming the first bad field (as its ``--flag``)."""
        for name in ("num_prompts", "num_samples", "max_new_tokens", "num_layers", "epochs", "batch_size",
                     "ttt_steps", "report_depth"):
            if getattr(self, name) < 1:
                flag = "layers" if name == "num_layers" else name.replace("_", "-")  # draft train's flag
                raise ValueError(f"--{flag} must be >= 1, got {getattr(self, name)}")
        if self.layout not in DRAFT_LAYOUTS:
            raise ValueError(f"--layout must be one of {', '.join(DRAFT_LAYOUTS)}, got {self.layout!r}")
        if not 0 <= self.validation_prompts < self.num_prompts:
            raise ValueError(f"--validation-prompts must be in [0, --num-prompts), got {self.validation_prompts}")
        if self.num_draft_tokens < 0:
            raise ValueError(f"--draft-tokens must be >= 0, got {self.num_draft_tokens}")
        if not (math.isfinite(self.lr) and self.lr > 0):  # inf > 0: an inf lr saved a draft of inf weights
            raise ValueError(f"--lr must be a finite number > 0, got {self.lr}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"--temperature must be a finite number >= 0, got {self.temperature}")


LATER_FIELDS = {"layout": "turbogrpo", "ttt_steps": 1, "init_from_policy": False, "report_depth": 4}
"""Recipe fields added after drafts were first built, with their defaults (``DraftRecipe.key_fields``)."""


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
# each at temperature 1 up to 320 tokens (~250k tokens), the last 8 prompts held out; 10 epochs over the
# draft vocabulary's head rows (a training step costs a fifth of one over the whole head).
BUILT_DRAFTS: dict[str, BuiltDraft] = {
    "smollm2-gsm8k": BuiltDraft("smollm2-gsm8k", "smollm2-135m-instruct", "configs/smollm2_gsm8k.toml",
                                DraftRecipe(num_prompts=256, num_samples=4, max_new_tokens=320, epochs=10,
                                            batch_size=8, num_draft_tokens=4096, validation_prompts=8)),
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


def checkout_path(path: str) -> Path:
    """``path`` as given when it exists from here, else relative to the checkout holding turbogrpo."""
    given = Path(path)
    return given if given.exists() else Path(__file__).resolve().parents[2] / path


def built_draft_folder(built: BuiltDraft, *, cache: Path | None = None) -> Path:
    """Where ``built`` lives: ``<cache>/drafts/<name>-<key>``, the key hashing its recipe, its config
    file's text and its model's fingerprint (so changing any of them builds anew)."""
    from turbogrpo.gguf_models import cache_root, gguf_fingerprint

    config_path = checkout_path(built.config)
    if not config_path.is_file():
        raise ValueError(f"draft {built.name!r} renders its prompts with {built.config}, which is not here; run "
                         "from the turbogrpo checkout")
    digest = hashlib.sha256(json.dumps({"model": gguf_fingerprint(built.model),
                                        "recipe": built.recipe.key_fields(), "config": config_path.read_text()},
                                       sort_keys=True).encode())
    return (cache or cache_root()) / "drafts" / f"{built.name}-{digest.hexdigest()[:12]}"


def samples_file(built: BuiltDraft, *, cache: Path | None = None) -> Path:
    """Where ``built``'s sampled completions are kept (``<cache>/drafts/samples/<name>-<key>.safetensors``),
    keyed by what decides them: the sampling fields of its recipe, its config's text and its model. So a
    draft retrained with other epochs, learning rate or vocabulary reuses them instead of sampling anew."""
    from turbogrpo.gguf_models import cache_root, gguf_fingerprint

    digest = hashlib.sha256(json.dumps({"model": gguf_fingerprint(built.model),
                                        "sampling": built.recipe.sampling(),
                                        "config": checkout_path(built.config).read_text()},
                                       sort_keys=True).encode())
    return (cache or cache_root()) / "drafts" / "samples" / f"{built.name}-{digest.hexdigest()[:12]}.safetensors"


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
                         f"{built.model}` (about 55 minutes on 2 CPU cores)")
    return str(folder)
