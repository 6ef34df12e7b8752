"""Loading Hugging Face causal LMs and tokenizers; tiny random models for tests; the demo model.

Models know nothing of training: this module only builds and loads them.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import socket
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlparse

import torch
import transformers
from safetensors import SafetensorError, safe_open
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from turbogrpo.gguf_models import gguf_model_folder, gguf_source_file, is_gguf_source
from turbogrpo.moe_routes import recomputation_contexts

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


class Architecture(NamedTuple):
    config_class: type[PretrainedConfig]
    model_class: type[PreTrainedModel]


# Architectures `tiny_model` can build. All are pure-attention decoders the shared-prefix forward runs.
ARCHITECTURES: dict[str, Architecture] = {
    "qwen2": Architecture(Qwen2Config, Qwen2ForCausalLM),
    "qwen3": Architecture(Qwen3Config, Qwen3ForCausalLM),
    "llama": Architecture(LlamaConfig, LlamaForCausalLM),
    "mistral": Architecture(MistralConfig, MistralForCausalLM),
}

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEMO_MODEL_DIR = ASSETS_DIR / "demo_model"
# Models shipped with turbogrpo, by the name a config's model.path may give: (folder, build script).
SHIPPED_MODELS: dict[str, tuple[Path, str]] = {
    "demo": (DEMO_MODEL_DIR, "scripts/build_demo_model.py"),  # the arithmetic task (turbogrpo.data.arithmetic)
    # the same task and tokenizer on a Qwen3.5-shaped hybrid (gated DeltaNet and full attention, 3:1)
    "demo-hybrid": (ASSETS_DIR / "demo_hybrid_model", "scripts/build_demo_model.py --model demo-hybrid"),
    "longform": (ASSETS_DIR / "longform_model", "scripts/build_longform_model.py"),  # turbogrpo.data.longform
}
# A Hub id is "name" or "owner/name"; anything else that does not exist locally is a missing folder.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``torch.dtype`` for a name in ``DTYPES`` (or a dtype, returned as is)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def checked_device(device: str | torch.device, key: str = "device", *, shown: object = None) -> torch.device:
    """``device`` as a torch.device; a ValueError naming ``key`` (and the value as the user wrote it,
    ``shown``) when it is no device or one this machine or torch build lacks."""
    shown = device if shown is None else shown
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{key}: {shown!r} is not a device; use \"cpu\", \"cuda\" or \"cuda:N\"") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{key}: {shown!r} needs CUDA, which this machine (or this torch build) lacks; "
                         "use \"cpu\"")
    if resolved.type == "cuda" and (resolved.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"{key}: {shown!r} names a GPU this machine lacks (it has "
                         f"{torch.cuda.device_count()}); use \"cuda\" or \"cuda:N\" with N below that")
    return resolved


def load_model_and_tokenizer(name_or_path: str | os.PathLike, *, dtype: str | torch.dtype = "float32",
                             device: str | torch.device | None = None,
                             attn_implementation: str = "sdpa") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM and its tokenizer from a local folder (``save_pretrained`` layout), a shipped or
    packaged model's name, a ``.gguf`` file, or a Hub name.

    The tokenizer gets a pad token (its eos token) if it has none, because batched rollouts pad.
    A name that is not an existing folder but looks like a Hub id ("owner/name") is tried on the Hub;
    when the Hub cannot be reached it comes from the local Hugging Face cache or fails at once (no
    minute of retries). Damaged weight files, pickle weights that hold code, a folder without tokenizer
    files and recurrent model types are named in a one-line ValueError. A folder of PEFT adapters (a LoRA
    run's ``final/``) loads as its base model with the adapters merged in.
    """
    torch_dtype = resolve_dtype(dtype)
    if device is not None:
        device = checked_device(device)
    source = str(resolve_model_path(name_or_path))
    local = Path(source).expanduser()
    if local.is_dir() and (local / ADAPTER_CONFIG).is_file() and not (local / "config.json").is_file():
        return _load_adapter_folder(local, dtype=torch_dtype, device=device, attn_implementation=attn_implementation)
    if local.is_dir():
        _check_model_folder(local, source)
        source = str(local)
    elif not _HUB_ID.match(source) or local.suffix in {".json", ".safetensors", ".bin"}:
        raise ValueError(f"model path {source!r} is not an existing folder; pass a folder written by "
                         "save_pretrained (with config.json and the weights) or a Hub name like 'owner/name'")
    hub_options = {} if local.is_dir() else _hub_options(source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **hub_options)
        if local.is_dir():
            tokenizer = declared_tokenizer(local, tokenizer)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype,
                                                     attn_implementation=attn_implementation, **hub_options)
    except SafetensorError as err:
        raise ValueError(f"could not load model {source!r}: {_damaged_weights(local) or 'a weight file'} is "
                         f"truncated or corrupt ({err}); copy or download the model again") from None
    except pickle.UnpicklingError:
        pickles = sorted(p.name for p in local.glob("*.bin")) if local.is_dir() else []
        raise ValueError(f"could not load model {source!r}: its pickle weights ({', '.join(pickles) or '*.bin'}) "
                         "hold more than tensors, which torch's safe loader refuses (unpickling them could run "
                         "code); get the model as safetensors (model.safetensors) from a source you trust") from None
    except ValueError as err:
        if "does not support an attention implementation" not in str(err):
            raise
        raise ValueError(f"could not load model {source!r}: its architecture does not run with SDPA attention, "
                         "which turbogrpo's forwards use; turbogrpo trains pure-attention decoders (Qwen2, Qwen3, "
                         "Llama, Mistral, GPT-2)") from None
    except OSError as err:
        problem = (f"folder {source!r} is not a complete save_pretrained folder (config.json, weights and "
                   "tokenizer files)" if local.is_dir() else
                   f"{source!r} is not a local folder and the Hugging Face Hub could not provide it (the Hub "
                   "is unreachable offline: download the model elsewhere and pass its local folder)")
        raise ValueError(f"could not load model: {problem}. Original error: {err}") from err
    if len(tokenizer) < 2:
        raise ValueError(f"the tokenizer of model {source!r} is empty ({len(tokenizer)} tokens); the folder needs "
                         f"its tokenizer files ({', '.join(TOKENIZER_FILES[:2])}): save them with "
                         "tokenizer.save_pretrained(folder)")
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {source!r} has neither a pad token nor an eos token; "
                             "set one of them in its tokenizer_config.json")
        tokenizer.pad_token = tokenizer.eos_token
    if device is not None:
        model = model.to(device)
    return model, tokenizer


# Files of which a saved tokenizer has at least one (fast tokenizers: tokenizer.json; slow ones: their vocab).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's: a folder of adapters (turbogrpo's LoRA export) names its base


def _check_model_folder(folder: Path, source: str) -> None:
    """ValueError naming what a model folder lacks (config.json, tokenizer files) or the model type
    turbogrpo cannot run, before transformers makes something of it: a run or checkpoint folder is
    named as such (with the final/ to pass), files of another user as not readable, and a model that
    is no causal LM (a BERT) as such."""
    run_folder = _run_folder_problem(folder, source)
    if run_folder:
        raise ValueError(run_folder)
    _check_readable(folder, source)
    if not (folder / "config.json").is_file():
        raise ValueError(f"model folder {source!r} has no config.json; pass a folder written by "
                         "save_pretrained (config.json, weights and tokenizer files)")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"model folder {source!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); copy "
                         "them from the model it was trained from, or save them with tokenizer.save_pretrained")
    from turbogrpo.architectures import NON_ATTENTION_MODEL_TYPES, SHARED_IN_TRAINING
    model_type = _model_type(str(folder))
    not_causal = _not_a_causal_lm(folder, model_type)
    if not_causal:
        raise ValueError(f"model folder {source!r} holds {not_causal}, not a causal language model; turbogrpo "
                         "trains and evaluates decoders that generate text (Qwen2, Qwen3, Llama, Mistral, GPT-2)")
    # A hybrid of SHARED_IN_TRAINING loads (its training forwards run); the rollout engines refuse it in one line.
    if model_type in NON_ATTENTION_MODEL_TYPES and model_type not in SHARED_IN_TRAINING:
        raise ValueError(f"model folder {source!r} holds a {model_type!r} model, whose layers mix tokens by "
                         "recurrence or convolution rather than softmax attention; turbogrpo trains pure-attention "
                         "decoders (Qwen2, Qwen3, Llama, Mistral, GPT-2)")


# What a training run writes (turbogrpo.train): a run folder holds these, a checkpoint folder STATE_FILE.
RUN_FOLDER_MARKERS = ("latest", "complete.json", "inputs.json", "metrics.jsonl")
CHECKPOINT_STATE_FILE = "state.json"


def _run_folder_problem(folder: Path, source: str) -> str | None:
    """The message for a training run's folder or one of its checkpoints passed as a model (None: neither)."""
    if folder.name.startswith("step-") and (folder / CHECKPOINT_STATE_FILE).is_file():
        run, kind = folder.parent, f"a checkpoint folder of the run in {str(folder.parent)!r}"
    elif any((folder / marker).is_file() for marker in RUN_FOLDER_MARKERS) or any(folder.glob("step-*/state.json")):
        run, kind = folder, "a training run's folder"
    else:
        return None
    final = run / "final"
    use = (f"pass its final model, {str(final)!r}" if (final / "config.json").is_file() or
           (final / ADAPTER_CONFIG).is_file() else
           f"the run has no final model yet ({str(final)!r} is written when it completes; resume it to finish)")
    return f"model path {source!r} is {kind}, not a model folder; {use}"


def _check_readable(folder: Path, source: str) -> None:
    """ValueError naming a file of the folder that this user may not read (a folder of another user)."""
    try:
        entries = sorted(p for p in folder.iterdir() if p.is_file())
    except PermissionError as err:
        raise ValueError(f"model folder {source!r} is not readable ({err.strerror}); it belongs to another user: "
                         "ask them to make it readable (chmod -R a+rX) or copy it") from None
    for path in entries:
        if not os.access(path, os.R_OK):
            raise ValueError(f"model folder {source!r} is not readable: {path.name} is not readable by this user "
                             "(it belongs to another user); ask them to make it readable (chmod -R a+rX) or copy it")


def _not_a_causal_lm(folder: Path, model_type: str) -> str | None:
    """What a folder's config.json describes when it is no causal LM ("a 'bert' model (BertForMaskedLM)"),
    else None. The architectures it was saved with decide; without them, its model type must have a
    causal-LM class and not be an encoder-decoder."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None  # transformers names a damaged config.json itself
    architectures = config.get("architectures") or []
    causal_classes = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if architectures and not any(a in causal_classes or a.endswith(("ForCausalLM", "LMHeadModel"))
                                 for a in architectures):
        return f"a {model_type!r} model ({', '.join(architectures)})"
    if config.get("is_encoder_decoder") or (not architectures and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        return f"a {model_type!r} model"
    return None


def _model_type(source: str) -> str:
    """The model_type a local folder's config.json records ("" when it cannot be read)."""
    try:
        return str(json.loads((Path(source) / "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def _load_adapter_folder(folder: Path, *, dtype: torch.dtype, device, attn_implementation: str,
                         ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A folder of PEFT adapters (a LoRA run's final/): its base model with the adapters merged in, and
    the folder's own tokenizer when it has one."""
    try:
        base = json.loads((folder / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"adapter folder {str(folder)!r}: cannot read base_model_name_or_path from "
                         f"{ADAPTER_CONFIG} ({err}); it should be the file PEFT's save_pretrained wrote") from None
    if not base:
        raise ValueError(f"adapter folder {str(folder)!r}: {ADAPTER_CONFIG} names no base model "
                         "(base_model_name_or_path); pass the base model's folder instead")
    model, tokenizer = load_model_and_tokenizer(base, dtype=dtype, device=device,
                                                attn_implementation=attn_implementation)
    from peft import PeftModel
    model = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        tokenizer = declared_tokenizer(folder, AutoTokenizer.from_pretrained(str(folder)))
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _hub_options(name: str, timeout_s: float = 3.0) -> dict:
    """from_pretrained options for Hub id ``name``: none when the Hub answers (or HF_HUB_OFFLINE is set,
    which already fails at once), ``local_files_only`` when it does not but the model is cached; else
    a ValueError at once instead of a minute of retries."""
    from huggingface_hub import constants, try_to_load_from_cache
    if constants.HF_HUB_OFFLINE or _reachable(constants.ENDPOINT, timeout_s):
        return {}
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return {"local_files_only": True}
    raise ValueError(f"model {name!r} is not a local folder, is not in the Hugging Face cache, and the Hub "
                     f"({constants.ENDPOINT}) cannot be reached; download it on a connected machine and pass its "
                     "folder (offline, set HF_HUB_OFFLINE=1 so Hub lookups fail at once)")


def _reachable(url: str, timeout_s: float) -> bool:
    """Whether a TCP connection to ``url``'s host opens (a proxy is trusted to reach it)."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    parsed = urlparse(url)
    try:
        socket.create_connection((parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)),
                                 timeout=timeout_s).close()
    except OSError:
        return False
    return True


def _damaged_weights(folder: Path) -> str | None:
    """The first safetensors file in ``folder`` whose header does not cover the file, or None."""
    for path in sorted(folder.glob("*.safetensors")) if folder.is_dir() else ():
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except SafetensorError:
            return str(path)
    return None


# Tokenizer classes that mean "the folder's own tokenizer.json, as it is".
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def declared_tokenizer(folder: Path, tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """The folder's own tokenizer when it declares a generic fast tokenizer (its tokenizer.json).

    transformers 5 loads some model types' tokenizer class whatever the folder says (a "qwen2" model
    gets Qwen2Tokenizer), which rebuilds a byte-level BPE and mis-reads custom tokenizer.json files
    (word- or character-level ones lose tokens).
    """
    config_file = folder / "tokenizer_config.json"
    if not config_file.is_file():
        return tokenizer
    declared = json.loads(config_file.read_text()).get("tokenizer_class")
    if declared not in GENERIC_TOKENIZER_CLASSES or type(tokenizer).__name__ in GENERIC_TOKENIZER_CLASSES:
        return tokenizer
    return PreTrainedTokenizerFast.from_pretrained(folder)


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward (non-reentrant checkpointing).

    transformers 5.x renamed ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable``;
    the old name warns. Both go through the model object, so PEFT wrappers forward the call. A layer whose
    forward replayed MoE routes (algo.routing_replay) replays them again when recomputed
    (``moe_routes.recomputation_contexts``; outside replay it adds nothing).
    """
    kwargs = {"use_reentrant": False, "context_fn": recomputation_contexts}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def tiny_model(arch: str = "qwen2", *, vocab_size: int = 128, hidden: int = 64, layers: int = 2,
               heads: int = 4, kv_heads: int = 2, intermediate: int | None = None,
               dtype: str | torch.dtype = "float32", seed: int = 0, attn_implementation: str = "sdpa",
               **config_overrides) -> PreTrainedModel:
    """A randomly initialised small model of ``arch`` (a key of ``ARCHITECTURES``), for tests.

    The same arguments give the same weights; the global torch RNG is left untouched.
    ``config_overrides`` go to the config class (e.g. ``sliding_window``, ``tie_word_embeddings``).
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads}) and heads by kv_heads "
                         f"({kv_heads})")
    config_class, model_class = ARCHITECTURES[arch]
    config = config_class(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, max_position_embeddings=2048, bos_token_id=None, eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1, **config_overrides)
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    return model.to(resolve_dtype(dtype)).eval()


_MOE_VOCAB = 64
_MOE_COMMON = dict(vocab_size=_MOE_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                   initializer_range=0.2, experts_implementation="eager", pad_token_id=None, bos_token_id=None,
                   eos_token_id=_MOE_VOCAB - 1)
_SOFTMAX_MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16)

MOE_FAMILIES = {
    # model type -> (config class, model class, the family's settings on top of _MOE_COMMON)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", _SOFTMAX_MOE | dict(norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", _SOFTMAX_MOE | dict(shared_expert_intermediate_size=16)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=6, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", _SOFTMAX_MOE),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(num_local_experts=6, num_experts_per_tok=2)),
    # DeepSeek-V3 style: grouped sigmoid routing with a score-correction bias, one shared expert beside
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                         moe_intermediate_size=16, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5,
                         rope_interleave=False, num_key_value_heads=4)),
    # gated DeltaNet then full attention, a sparse MoE with a gated shared expert
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    _SOFTMAX_MOE | dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                       shared_expert_intermediate_size=16, linear_num_key_heads=2,
                                       linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)),
}


def tiny_moe(family: str, dtype: str | torch.dtype = torch.float64, seed: int = 0, **overrides) -> PreTrainedModel:
    """A randomly initialised tiny mixture-of-experts model of ``family`` (a key of ``MOE_FAMILIES``: the families
    ``turbogrpo.moe_routes`` records and replays), for tests and bench/routing_replay.py. Experts run eagerly (the
    grouped matmul has no float64 kernel); the global torch RNG is left untouched."""
    if family not in MOE_FAMILIES:
        raise ValueError(f"family must be one of {sorted(MOE_FAMILIES)}, got {family!r}")
    config_name, model_name, settings = MOE_FAMILIES[family]
    config = getattr(transformers, config_name)(**(_MOE_COMMON | settings | overrides))
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(config)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):   # a bias that moves the choice, as trained models have
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    return model.to(resolve_dtype(dtype)).eval()


def shipped_model_path(name: str) -> Path:
    """Folder of a model shipped with turbogrpo (``SHIPPED_MODELS``: "demo", "demo-hybrid" or "longform")."""
    folder, script = SHIPPED_MODELS[name]
    if not (folder / "config.json").is_file():
        raise ValueError(f"the {name} model is missing from {folder}; rebuild it with `python {script}`")
    return folder


def resolve_model_path(path: str | os.PathLike) -> str | Path:
    """A config's model.path as something ``from_pretrained`` reads: the shipped folder for a shipped
    model's name, the cached conversion for a ``.gguf`` file or a packaged GGUF model's name
    (``turbogrpo.gguf_models``), else ``path`` itself."""
    if str(path) in SHIPPED_MODELS:
        return shipped_model_path(str(path))
    if is_gguf_source(path):
        return gguf_model_folder(path)
    return path


def model_source(path: str) -> Path:
    """What a config's model.path reads on disk, without converting anything: a shipped model's folder,
    a packaged GGUF model's file, else ``path`` itself (a folder, a .gguf file, or a Hub id)."""
    if path in SHIPPED_MODELS:
        return SHIPPED_MODELS[path][0]
    return gguf_source_file(path) if is_gguf_source(path) else Path(path)


DEMO_MODELS = ("demo", "demo-hybrid")
"""The shipped models of the demo's arithmetic task (one tokenizer): attention only, and a Qwen3.5-shaped hybrid."""


def demo_model_path(name: str = "demo") -> Path:
    """Folder of a demo model shipped with turbogrpo (``DEMO_MODELS``; built by scripts/build_demo_model.py)."""
    if name not in DEMO_MODELS:
        raise ValueError(f"demo model {name!r} is not one of {', '.join(DEMO_MODELS)}")
    return shipped_model_path(name)


def load_demo_model(name: str = "demo", *, dtype: str | torch.dtype = "float32",
                    device: str | torch.device | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A shipped demo model (``DEMO_MODELS``) and its tokenizer (see turbogrpo.data.arithmetic for its task)."""
    return load_model_and_tokenizer(demo_model_path(name), dtype=dtype, device=device)
