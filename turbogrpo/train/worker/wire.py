"""Messages between the trainer and a rollout worker on another machine (train.rollout_worker = "remote"): a JSON
header and tensors, never pickles (what arrives from the network is data, not code to run).

A message is a header (UTF-8 JSON) and a payload: every tensor of the message flat, as bytes, one after the other,
each at a 16-byte aligned offset so that it can be viewed back as its dtype without a copy. Both travel over an
authenticated, encrypted ``secure_channel.Channel``; what arrives is still checked here (a header that is not a JSON
object with ``kind`` and ``layout``, a tensor outside the payload: ``BadMessage``). The
header's ``layout`` says where each tensor lies: ``[name, dtype, shape, offset, num_bytes, on_device]``.

What travels (``remote.py``): weights (a version's trainable parameters), requests (a step's prompts,
seed and version; the prompts' rows where the worker needs them: an [env] run's columns and chat messages, a
partial-rollouts run's starts and, once, a checkpoint's carried generations), rollouts (``Groups``' fields and the
rollout's stats; an [env] run's episodes as ``EpisodeRecord``s; a partial-rollouts run's batch rows and the pool
after it), errors (one line of text).
"""

from __future__ import annotations

import dataclasses
import json
import torch
from torch import Tensor

from turbogrpo.batch import Groups
from turbogrpo.data import PromptExample
from turbogrpo.env import EnvRollout, EpisodeRecord
from turbogrpo.rollout import Rollout
from turbogrpo.rollout.multiturn import MultiTurnRollout, MultiTurnStats
from turbogrpo.rollout.types import RolloutStats
from turbogrpo.speculative.decode import SpeculativeStats
from turbogrpo.speculative.multiturn import MultiTurnSpeculativeStats
from turbogrpo.train.worker.partial_rollouts import PendingGroup, pool_state, restore_pool
from turbogrpo.train.worker.protocol import Drawn, Request

ALIGN = 16
"""Bytes each tensor's offset in a payload is a multiple of (the widest dtype's size, with room)."""

DTYPES = {str(dtype): dtype for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
"""The dtypes a message may carry, by name (anything else in a header is refused, not looked up)."""


@dataclasses.dataclass
class Message:
    """One message: its JSON-able header (``kind`` first) and its tensors by name."""

    header: dict
    tensors: dict[str, Tensor] = dataclasses.field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.header["kind"]


@dataclasses.dataclass
class Frame:
    """A message ready to send: the header's bytes and the payload ``[B]`` (uint8, CPU)."""

    header: bytes
    payload: Tensor


class BadMessage(ValueError):
    """What arrived is not a message of this protocol (one line saying why)."""


def encode(message: Message) -> Frame:
    """The frame of ``message`` (its tensors copied into one host buffer: the sender may change them after)."""
    layout, parts, offset = [], [], 0
    for name, tensor in message.tensors.items():
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()  # host sync on a GPU
        layout.append([name, str(tensor.dtype), list(tensor.shape), offset, data.numel(), tensor.device.type != "cpu"])
        padding = -data.numel() % ALIGN
        parts += [data, torch.zeros(padding, dtype=torch.uint8)] if padding else [data]
        offset += data.numel() + padding
    payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return Frame(json.dumps({**message.header, "layout": layout}).encode(), payload)


def decode(header: bytes, payload: Tensor, device: torch.device) -> Message:
    """The message of a received frame; tensors that were on an accelerator go to ``device``, the rest stay on
    the host (views of ``payload``). Anything else is a BadMessage naming what is wrong."""
    try:
        fields = json.loads(header.decode())
    except (UnicodeDecodeError, ValueError) as err:
        raise BadMessage(f"its header is not JSON ({err})") from None
    if not isinstance(fields, dict):
        raise BadMessage(f"its header is a JSON {type(fields).__name__}, not an object")
    for key, kind in (("kind", str), ("layout", list)):
        if not isinstance(fields.get(key), kind):
            raise BadMessage(f"its header has no {key!r} (a {kind.__name__})")
    tensors = {}
    for entry in fields.pop("layout"):
        name, tensor, on_device = _tensor_of(entry, payload)
        tensors[name] = tensor.to(device) if on_device else tensor
    return Message(fields, tensors)


def _tensor_of(entry, payload: Tensor) -> tuple[str, Tensor, bool]:
    """One layout entry's tensor: a view of ``payload`` where the entry's dtype, shape and bytes agree."""
    try:
        name, dtype, shape, offset, num_bytes, on_device = entry
    except (TypeError, ValueError):
        raise BadMessage(f"a tensor's layout entry {str(entry)[:80]} is not [name, dtype, shape, offset, bytes, "
                         "on_device]") from None
    if dtype not in DTYPES:
        raise BadMessage(f"it carries tensor {name!r} of dtype {dtype!r}, not one of {sorted(DTYPES)}")
    if not (isinstance(offset, int) and isinstance(num_bytes, int) and 0 <= offset
            and offset + num_bytes <= payload.numel() and offset % ALIGN == 0):
        raise BadMessage(f"tensor {name!r} lies outside the message's {payload.numel()} payload bytes")
    try:
        return name, payload[offset:offset + num_bytes].view(DTYPES[dtype]).reshape(shape), bool(on_device)
    except (RuntimeError, TypeError) as err:
        raise BadMessage(f"tensor {name!r}'s shape {shape} does not match its {num_bytes} bytes of {dtype} "
                         f"({str(err).splitlines()[0]})") from None


def send(channel, frame: Frame, timeout_s: float | None = None) -> None:
    """``frame`` over ``channel`` (``secure_channel.Channel``; blocks until sent; past ``timeout_s``,
    TimeoutError: a peer that takes nothing, e.g. a hung machine, leaves a large frame unsent)."""
    if timeout_s is not None:
        channel.sock.settimeout(timeout_s)
    try:
        channel.send(frame.header, frame.payload)
    finally:
        if timeout_s is not None:
            channel.sock.settimeout(None)


def receive(channel, device: torch.device) -> Message:
    """The next message on ``channel`` (blocks; ConnectionError when the peer is gone, BadMessage or
    ``ChannelError`` for what is not a message of ours)."""
    header, payload = channel.receive()
    return decode(header, payload, device)


# --- what the messages hold ------------------------------------------------------------------------------


def parsed(read, message: Message):
    """``read(message)`` (``drawn_of``, ``request_of``, ...), where a field missing or of the wrong kind is a
    BadMessage naming it, not a KeyError from deep inside."""
    try:
        return read(message)
    except BadMessage:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as err:
        what = f"field {err.args[0]!r} is missing" if isinstance(err, KeyError) else str(err).splitlines()[0]
        raise BadMessage(f"its {message.kind!r} message is malformed: {what}") from None


def tensor_list(prefix: str, tensors: list[Tensor]) -> dict[str, Tensor]:
    """``tensors`` named ``prefix/0``, ``prefix/1``, ..."""
    return {f"{prefix}/{i}": t for i, t in enumerate(tensors)}


def listed(prefix: str, count: int, tensors: dict[str, Tensor]) -> list[Tensor]:
    """``tensor_list``'s list back."""
    return [tensors[f"{prefix}/{i}"] for i in range(count)]


STATS = {cls.__name__: cls for cls in (RolloutStats, MultiTurnStats, SpeculativeStats, MultiTurnSpeculativeStats)}
"""The rollout stats a message may carry, by name."""


def rollout_message(step: int, rollout: Rollout) -> Message:
    """A rollout: every field of its ``Groups`` (tensor lists as tensors, the rest in the header) and its stats."""
    kind = type(rollout.stats).__name__
    if STATS.get(kind) is not type(rollout.stats):
        raise ValueError(f"a remote rollout worker sends rollouts with stats {sorted(STATS)}, not {kind}")
    groups, fields, tensors = rollout.groups, {}, {}
    for field in dataclasses.fields(groups):
        value = getattr(groups, field.name)
        if isinstance(value, Tensor):
            tensors[field.name] = value
            fields[field.name] = {"tensor": True}
        elif isinstance(value, list) and value and isinstance(value[0], Tensor):
            tensors.update(tensor_list(field.name, value))
            fields[field.name] = {"tensors": len(value)}
        elif value is not None:
            fields[field.name] = {"value": list(value) if isinstance(value, tuple) else value}
    return Message({"kind": "rollout", "step": step, "groups": fields, "stats": dataclasses.asdict(rollout.stats),
                    "stats_kind": kind}, tensors)


def rollout_of(message: Message) -> Rollout:
    """``rollout_message``'s rollout back."""
    fields = {}
    for name, how in message.header["groups"].items():
        if "tensor" in how:
            fields[name] = message.tensors[name]
        elif "tensors" in how:
            fields[name] = listed(name, how["tensors"], message.tensors)
        else:
            fields[name] = how["value"]
    stats = STATS[message.header["stats_kind"]](**message.header["stats"])  # (a KeyError for a name not there)
    return Rollout(Groups(**fields), stats)


def example_rows(examples: list[PromptExample]) -> list[dict]:
    """The prompts' rows as JSON (their token ids travel as tensors, ``examples_of``): a column JSON cannot hold is
    a ValueError naming it, before anything is sent."""
    rows = []
    for example in examples:
        for name, value in example.columns.items():
            try:
                json.dumps(value)
            except (TypeError, ValueError) as err:
                raise ValueError(f"column {name!r} of row {example.index} cannot travel to a remote rollout worker, "
                                 f"which gets the rows as JSON ({err}); make it a JSON value (string, number, list, "
                                 "dict) or use the local worker (train.rollout_worker = \"local\")") from None
        rows.append({"text": example.text, "index": example.index, "columns": example.columns,
                     "messages": None if example.messages is None else list(example.messages)})
    return rows


def examples_of(rows: list[dict], token_ids: list[Tensor]) -> list[PromptExample]:
    """``example_rows``' examples back, with their ``[P]`` token ids."""
    return [PromptExample(row["text"], ids, row["columns"], row["index"],
                          None if row["messages"] is None else tuple(row["messages"]))
            for row, ids in zip(row_list(rows), token_ids, strict=True)]


def row_list(rows) -> list[dict]:
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise ValueError("a message's rows are not a list of JSON objects")
    return rows


def pool_part(pool: list[PendingGroup]) -> tuple[dict, dict[str, Tensor]]:
    """Partial rollouts' pool (``pool_state``: ids, log-probs and versions as tensors) with its groups' rows."""
    tensors, groups = pool_state(pool)
    examples = [group.example for group in pool]
    return ({"groups": groups, "rows": example_rows(examples)},
            {**tensors, **tensor_list("pool_prompts", [e.token_ids for e in examples])})


def pool_of(header: dict, tensors: dict[str, Tensor]) -> list[PendingGroup]:
    """``pool_part``'s pool back."""
    examples = examples_of(header["rows"], listed("pool_prompts", len(header["rows"]), tensors))
    return restore_pool(tensors, header["groups"], examples)


def episodes_part(episodes: EnvRollout) -> dict:
    """An [env] rollout's episodes as ``EpisodeRecord``s (each environment's reward read now, on this side), with
    the rollout's per-conversation turns and errors, prompt texts and env/* metrics (JSON: the groups and stats
    travel as the rollout)."""
    return {"records": [e.record().to_json() for e in episodes.episodes], "num_turns": list(episodes.rollout.num_turns),
            "errors": list(episodes.rollout.errors), "prompt_texts": list(episodes.prompt_texts),
            "metrics": dict(episodes.metrics)}


def episodes_of(part: dict, rollout: Rollout) -> EnvRollout:
    """``episodes_part``'s episodes back, around ``rollout`` (the message's)."""
    records = [EpisodeRecord.from_json(r) for r in row_list(part["records"])]
    multiturn = MultiTurnRollout(rollout.groups, rollout.stats, list(part["num_turns"]), list(part["errors"]), records)
    return EnvRollout(multiturn, records, list(part["prompt_texts"]), dict(part["metrics"]))


def request_message(request: Request, with_rows: bool) -> Message:
    """A step's request: its prompts, seed and version; ``with_rows``: the prompts' rows too (``example_rows``), the
    groups the step trains and a resumed run's carried pool (partial rollouts)."""
    header = {"kind": "request", "step": request.step, "seed": request.seed, "version": request.version,
              "num_prompts": len(request.prompts)}
    tensors = tensor_list("prompts", request.prompts)
    if with_rows:
        header.update(rows=example_rows(request.examples), num_groups=request.num_groups)
    if request.carried is not None:
        header["carried"], pool_tensors = pool_part(request.carried)
        tensors.update(pool_tensors)
    return Message(header, tensors)


def request_of(message: Message) -> Request:
    """``request_message``'s request back (no rows: ``examples`` is empty)."""
    header = message.header
    prompts = listed("prompts", header["num_prompts"], message.tensors)
    examples = examples_of(header["rows"], prompts) if "rows" in header else []
    carried = pool_of(header["carried"], message.tensors) if "carried" in header else None
    return Request(header["step"], header["seed"], header["version"], prompts, examples,
                   header.get("num_groups", 0), carried)


def drawn_message(step: int, drawn: Drawn) -> Message:
    """Step ``step``'s rollout (``rollout_message``) with what else the worker drew: an [env] run's episodes
    (``episodes_part``), a partial-rollouts run's batch rows and the pool after it (``pool_part``)."""
    message = rollout_message(step, drawn.rollout)
    if drawn.episodes is not None:
        message.header["episodes"] = episodes_part(drawn.episodes)
    if drawn.examples is not None:
        message.header["rows"] = example_rows(drawn.examples)
        message.tensors.update(tensor_list("row_prompts", [e.token_ids for e in drawn.examples]))
    if drawn.carried is not None:
        message.header["carried"], pool_tensors = pool_part(drawn.carried)
        message.tensors.update(pool_tensors)
    return message


def drawn_of(message: Message) -> Drawn:
    """``drawn_message``'s ``Drawn`` back."""
    header, tensors = message.header, message.tensors
    rollout = rollout_of(message)
    episodes = episodes_of(header["episodes"], rollout) if "episodes" in header else None
    examples = (examples_of(header["rows"], listed("row_prompts", len(header["rows"]), tensors))
                if "rows" in header else None)
    carried = pool_of(header["carried"], tensors) if "carried" in header else None
    return Drawn(rollout, episodes, examples, carried)
