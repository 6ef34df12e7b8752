"""Resumable checkpoints: safetensors for every tensor, JSON for every scalar, written atomically.

Nothing is pickled (``torch.load`` is never called): a checkpoint folder ``step-000120/`` holds

* ``model.safetensors``      trainable parameters by name (LoRA: the adapters only; the frozen base
                             is reloaded from ``model.path``);
* ``optimizer.safetensors``  optimizer state tensors, keys ``"<param name>/<state key>"``;
* ``rng-rank<r>.safetensors`` torch CPU/CUDA and numpy RNG states of rank r;
* ``extra-rank<r>.safetensors`` rank r's own component state, when given (the online draft, its
                             optimizer and acceptance statistics); its scalars go in ``rng-rank<r>.json``;
* ``state.json``             step, optimizer hyper-parameters, python/numpy RNG scalars, data position,
                             counters; written last, so a folder without it is incomplete.

A checkpoint is written into ``.tmp-step-000120/`` and renamed into place, then the ``latest`` file is
replaced (temp + rename). A crash at any moment leaves the previous checkpoint intact and ``latest``
pointing at a complete folder. Weights that are not finite are never written, and a checkpoint is
verified (every file readable and whole) before a run resumes from it: a damaged one is named and
passed over for the previous one.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from turbogrpo.files import describe_os_error, fsync_dir, replace_folder, save_json, save_tensors, write_text_atomically
from turbogrpo.placement import DistInfo
from turbogrpo.train.distributed import all_reduce_max_int

LATEST_FILE = "latest"
STATE_FILE = "state.json"
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class CheckpointError(ValueError):
    """A checkpoint could not be written (disk full, non-finite weights); the previous one is intact."""


@dataclass
class Resumed:
    """What a loaded checkpoint hands back besides the restored model/optimizer/RNG."""

    step: int
    """GRPO steps completed."""
    state: dict[str, Any]
    """The ``extra`` dict given to :func:`save_checkpoint` (data position, counters, metric history)."""
    rank_state: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None
    """The ``rank_state`` this rank gave to :func:`save_checkpoint` (None if it gave none)."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def save_checkpoint(root: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    extra: dict[str, Any], dist: DistInfo, *, keep: int = 2,
                    rank_state: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None) -> Path:
    """Write checkpoint ``root/step-XXXXXX`` atomically and point ``root/latest`` at it.

    Every rank must call this (the full state dicts are gathered collectively under FSDP2); rank 0
    writes the shared files, every rank writes its own RNG state and ``rank_state`` (tensors, JSON
    scalars) when given.
    """
    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}"
    model_state = _trainable_state(model)
    # Host sync, once per checkpoint: inf/NaN weights would make every later step fail.
    nonfinite = [name for name, t in model_state.items() if not bool(t.isfinite().all())]
    if all_reduce_max_int(int(bool(nonfinite)), dist, dist.device):
        raise CheckpointError(f"not saving checkpoint {final}: the weights are not finite (inf/NaN in "
                              f"{', '.join(nonfinite[:3]) or 'a shard on another rank'}); {_previous(root)}. Lower "
                              "optim.lr or set optim.max_grad_norm, then continue with --resume")
    optim_state = get_optimizer_state_dict(model, optimizer, options=_FULL)
    try:
        if dist.is_main:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # debris of a crash during an earlier attempt
            tmp.mkdir()
        dist.barrier()
        rng_tensors, rng_scalars = capture_rng_state()
        save_tensors(rng_tensors, tmp / f"rng-rank{dist.rank}.safetensors")
        rank_json: dict[str, Any] = {"rng": rng_scalars}
        if rank_state is not None:
            save_tensors(rank_state[0], tmp / f"extra-rank{dist.rank}.safetensors")
            rank_json["extra"] = rank_state[1]
        save_json(rank_json, tmp / f"rng-rank{dist.rank}.json")
        dist.barrier()
        if dist.is_main:
            save_tensors(model_state, tmp / "model.safetensors")
            optim_tensors, optim_scalars = _flatten_optimizer_state(optim_state)
            save_tensors(optim_tensors, tmp / "optimizer.safetensors")
            save_json({"step": step, "world_size": dist.world_size, "optimizer": optim_scalars, "extra": extra},
                      tmp / STATE_FILE)
            fsync_dir(tmp)
            replace_folder(tmp, final)  # an existing copy: re-running a step after a resume
            write_text_atomically(root / LATEST_FILE, final.name)
            fsync_dir(root)
            _prune(root, keep, step)
    except OSError as err:  # e.g. disk full: the previous checkpoint and `latest` are untouched
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint {final} ({describe_os_error(err)}); {_previous(root)}. "
                              "Free space and continue with --resume") from err
    except BaseException:  # Ctrl-C or SIGTERM mid-write: the previous checkpoint stands, and no debris
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    dist.barrier()
    return final


def checkpoint_problem(path: str | Path) -> str | None:
    """Why a run cannot resume from checkpoint folder ``path`` (naming the bad file), or None if it can.

    Reads every JSON file and every safetensors header (safetensors checks that the file covers all
    the tensors its header lists, so a truncated file is caught without loading the tensors).
    """
    path = Path(path)
    state = _read_json(path / STATE_FILE)
    if isinstance(state, str):
        return state
    missing = {"step", "world_size", "optimizer", "extra"} - state.keys()
    if missing:
        return f"{path / STATE_FILE} lacks {sorted(missing)}"
    ranks = range(state["world_size"])
    for name in ["model.safetensors", "optimizer.safetensors", *(f"rng-rank{r}.safetensors" for r in ranks)]:
        try:
            with safe_open(str(path / name), framework="pt"):
                pass
        except Exception as err:  # SafetensorError (truncated, corrupt) or OSError (missing)
            return f"{path / name} is missing, truncated or corrupt ({err})"
    for name in (f"rng-rank{r}.json" for r in ranks):
        rng = _read_json(path / name)
        if isinstance(rng, str):
            return rng
        if "rng" not in rng:
            return f"{path / name} lacks 'rng'"
        if "extra" in rng:  # this rank's own component state (the online draft)
            extra = path / name.replace("rng-rank", "extra-rank").replace(".json", ".safetensors")
            try:
                with safe_open(str(extra), framework="pt"):
                    pass
            except Exception as err:
                return f"{extra} is missing, truncated or corrupt ({err})"
    return None


def _read_json(path: Path) -> dict | str:
    """The JSON object in ``path``, or a message naming the file and what is wrong with it."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return f"{path} is missing (the checkpoint was not finished)"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"{path} is truncated or corrupt ({err})"
    return value if isinstance(value, dict) else f"{path} holds {type(value).__name__}, not a JSON object"


def _previous(root: Path) -> str:
    latest = latest_checkpoint(root)
    return (f"the previous checkpoint {latest} and the `latest` pointer are intact" if latest is not None
            else "no earlier checkpoint exists")


def latest_checkpoint(root: str | Path, notice: Callable[[str], None] | None = None) -> Path | None:
    """The newest complete checkpoint under ``root`` (or None).

    ``latest`` names it; when that folder is missing, no checkpoint after it counts (the pointer is
    written last) and the newest earlier one is taken. With ``notice``, every checkpoint is verified
    (:func:`checkpoint_problem`) and each damaged one is passed over with a notice naming the bad file.
    """
    root = Path(root)
    pointer = root / LATEST_FILE
    named = pointer.read_text().strip() if pointer.is_file() else ""
    complete = sorted((p for p in root.glob("step-*") if (p / STATE_FILE).is_file()), reverse=True)
    if (root / named / STATE_FILE).is_file() and named.startswith("step-"):
        complete = [p for p in complete if p.name <= named]  # later ones are not this run's
    for candidate in complete:
        problem = checkpoint_problem(candidate) if notice is not None else None
        if problem is None:
            return candidate
        notice(f"checkpoint {candidate} is unusable: {problem}; trying the one before it")
    return None


def checkpoint_record(path: str | Path) -> dict[str, Any]:
    """``state.json`` of a verified checkpoint (step, world size, the ``extra`` given to
    :func:`save_checkpoint`), read without loading any tensor."""
    return json.loads((Path(path) / STATE_FILE).read_text())


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    dist: DistInfo) -> Resumed:
    """Restore model, optimizer and this rank's RNG states from ``path``; return step and extra state."""
    path = Path(path)
    state = json.loads((path / STATE_FILE).read_text())
    if state["world_size"] != dist.world_size:
        raise ValueError(f"checkpoint {str(path)!r} was written by {state['world_size']} processes; resuming "
                         f"with {dist.world_size} would change the data each rank sees. Resume with "
                         f"--nproc-per-node={state['world_size']}.")
    model_state = load_file(path / "model.safetensors")
    set_model_state_dict(model, model_state, options=StateDictOptions(full_state_dict=True, strict=False))
    optim_state = _unflatten_optimizer_state(load_file(path / "optimizer.safetensors"), state["optimizer"])
    tuple_keys = {k for g in optimizer.param_groups for k, v in g.items() if isinstance(v, tuple)}
    set_optimizer_state_dict(model, optimizer, optim_state, options=StateDictOptions(full_state_dict=True))
    for group in optimizer.param_groups:  # JSON has no tuples; give hyper-parameters their own type back
        for key in tuple_keys & group.keys():
            group[key] = tuple(group[key])
    rank_json = json.loads((path / f"rng-rank{dist.rank}.json").read_text())
    restore_rng_state(load_file(path / f"rng-rank{dist.rank}.safetensors"), rank_json["rng"])
    rank_state = None
    if "extra" in rank_json:
        rank_state = (load_file(path / f"extra-rank{dist.rank}.safetensors"), rank_json["extra"])
    return Resumed(step=state["step"], state=state["extra"], rank_state=rank_state)


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The gathered full state dict when parameters are sharded (FSDP2: every rank must call this);
    None otherwise, so ``save_pretrained`` reads the model's own."""
    from torch.distributed.tensor import DTensor
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return get_model_state_dict(model, options=_FULL)
    return None


# --- RNG ------------------------------------------------------------------------------------------


def capture_rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """All RNG states of this process: (tensors for safetensors, scalars for JSON)."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    tensors["numpy_keys"] = torch.from_numpy(keys.astype(np.int64))
    version, py_state, gauss_next = random.getstate()
    scalars = {"numpy": [kind, int(pos), int(has_gauss), float(cached)],
               "python": [version, list(py_state), gauss_next]}
    return tensors, scalars


def restore_rng_state(tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        cuda_states = [tensors[k] for k in sorted(t for t in tensors if t.startswith("torch_cuda_"))]
        if cuda_states:
            torch.cuda.set_rng_state_all(cuda_states)
    kind, pos, has_gauss, cached = scalars["numpy"]
    np.random.set_state((kind, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    version, py_state, gauss_next = scalars["python"]
    random.setstate((version, tuple(py_state), gauss_next))


# --- helpers --------------------------------------------------------------------------------------


def _trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (gathered) tensors of the trainable parameters, by name; tied weights appear once."""
    full = get_model_state_dict(model, options=_FULL)
    names = {_strip_wrappers(n) for n, p in model.named_parameters() if p.requires_grad}
    return {n: t for n, t in full.items() if n in names}


def _strip_wrappers(name: str) -> str:
    # DDP prefixes "module."; get_model_state_dict already strips it, so names must match that.
    return name.removeprefix("module.")


def _flatten_optimizer_state(optim_state: dict) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors, scalars = {}, {"param_groups": [], "state_scalars": {}}
    for name, per_param in optim_state["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}/{key}"] = value
            else:
                scalars["state_scalars"].setdefault(name, {})[key] = value
    for group in optim_state["param_groups"]:
        scalars["param_groups"].append({k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()})
    return tensors, scalars


def _unflatten_optimizer_state(tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> dict:
    state: dict[str, dict[str, Any]] = {}
    for flat, value in tensors.items():
        name, key = flat.rsplit("/", 1)
        state.setdefault(name, {})[key] = value
    for name, per_param in scalars["state_scalars"].items():
        state.setdefault(name, {}).update(per_param)
    return {"state": state, "param_groups": scalars["param_groups"]}


def _prune(root: Path, keep: int, step: int) -> None:
    """Keep the ``keep`` newest complete checkpoints up to ``step`` (the one just written); never touch
    a later one (it is not this run's: a resume from an earlier checkpoint leaves it for the user)."""
    complete = sorted(p for p in root.glob("step-*") if (p / STATE_FILE).is_file() and p.name <= checkpoint_name(step))
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
