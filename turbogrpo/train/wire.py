"""Messages between the trainer and a rollout worker on another machine (train.rollout_worker = "remote"): a JSON
header and tensors, never pickles (what arrives from the network is data, not code to run).

A message travels over a two-process ``torch.distributed`` group as three sends: ``[2]`` int64 sizes (header bytes,
payload bytes), the header (UTF-8 JSON, uint8), and the payload: every tensor of the message flat, as bytes, one
after the other, each at a 16-byte aligned offset so that it can be viewed back as its dtype without a copy. The
header's ``layout`` says where each tensor lies: ``[name, dtype, shape, offset, num_bytes, on_device]``.

What travels (``remote_transport.py``): weights (a version's trainable parameters), requests (a step's prompts,
seed and version), rollouts (``Groups``' fields and the rollout's stats), errors (one line of text).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import torch
from torch import Tensor

from turbogrpo.batch import Groups
from turbogrpo.rollout import Rollout
from turbogrpo.rollout.types import RolloutStats

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
    """A message ready to send: ``[2]`` sizes, the header's bytes ``[H]`` and the payload ``[B]`` (uint8, CPU)."""

    sizes: Tensor
    header: Tensor
    payload: Tensor


def encode(message: Message) -> Frame:
    """The frame of ``message`` (its tensors copied into one host buffer: the sender may change them after)."""
    layout, parts, offset = [], [], 0
    for name, tensor in message.tensors.items():
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()  # host sync on a GPU
        layout.append([name, str(tensor.dtype), list(tensor.shape), offset, data.numel(), tensor.device.type != "cpu"])
        padding = -data.numel() % ALIGN
        parts += [data, torch.zeros(padding, dtype=torch.uint8)] if padding else [data]
        offset += data.numel() + padding
    header = json.dumps({**message.header, "layout": layout}).encode()
    payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return Frame(torch.tensor([len(header), payload.numel()], dtype=torch.int64),
                 torch.frombuffer(bytearray(header), dtype=torch.uint8), payload)


def decode(header: Tensor, payload: Tensor, device: torch.device) -> Message:
    """The message of a received frame; tensors that were on an accelerator go to ``device``, the rest stay on
    the host (views of ``payload``)."""
    fields = json.loads(bytes(header.numpy()).decode())
    tensors = {}
    for name, dtype, shape, offset, num_bytes, on_device in fields.pop("layout"):
        if dtype not in DTYPES:
            raise ValueError(f"a message carries tensor {name!r} of dtype {dtype!r}, not one of {sorted(DTYPES)}")
        tensor = payload[offset:offset + num_bytes].view(DTYPES[dtype]).reshape(shape)
        tensors[name] = tensor.to(device) if on_device else tensor
    return Message(fields, tensors)


def send(group, peer: int, frame: Frame, timeout_s: float | None = None) -> None:
    """``frame`` to rank ``peer`` of ``group`` (blocks until it is sent; past ``timeout_s``, TimeoutError: a peer
    that takes nothing, e.g. a hung machine, leaves a large frame unsent)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for part in (frame.sizes, frame.header, frame.payload):
        if part.numel():
            finish(group.send([part], peer, 0), deadline)


def receive(group, peer: int, device: torch.device) -> Message:
    """The next message from rank ``peer`` of ``group`` (blocks; raises when the peer is gone)."""
    sizes = torch.empty(2, dtype=torch.int64)
    finish(group.recv([sizes], peer, 0))
    header_bytes, payload_bytes = sizes.tolist()
    header = torch.empty(header_bytes, dtype=torch.uint8)
    finish(group.recv([header], peer, 0))
    payload = torch.empty(payload_bytes, dtype=torch.uint8)
    if payload_bytes:
        finish(group.recv([payload], peer, 0))
    return decode(header, payload, device)


def finish(work, deadline: float | None = None) -> None:
    """Wait for a send or receive so that Ctrl-C and SIGTERM still reach this thread: ``Work.wait()`` blocks in C++,
    where Python runs no signal handler until it returns, which a peer that hangs never lets happen (and gloo's
    point-to-point work cannot be polled: it completes inside ``wait``). So ``wait`` runs on a helper thread while
    this one waits on an event, which a signal interrupts. Raises the operation's error (the peer gone), or
    TimeoutError past ``deadline`` (``time.monotonic()``; the helper is left to the operation)."""
    done, failed = threading.Event(), []

    def wait() -> None:
        try:
            work.wait()
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread, which raises it
            failed.append(err)
        finally:
            done.set()

    threading.Thread(target=wait, name="turbogrpo-wire", daemon=True).start()
    while not done.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError("the other side took nothing")
    if failed:
        raise failed[0]


# --- what the messages hold ------------------------------------------------------------------------------


def tensor_list(prefix: str, tensors: list[Tensor]) -> dict[str, Tensor]:
    """``tensors`` named ``prefix/0``, ``prefix/1``, ..."""
    return {f"{prefix}/{i}": t for i, t in enumerate(tensors)}


def listed(prefix: str, count: int, tensors: dict[str, Tensor]) -> list[Tensor]:
    """``tensor_list``'s list back."""
    return [tensors[f"{prefix}/{i}"] for i in range(count)]


def rollout_message(step: int, rollout: Rollout) -> Message:
    """A single-turn rollout: every field of its ``Groups`` (tensor lists as tensors, the rest in the header) and
    its stats."""
    if type(rollout.stats) is not RolloutStats:  # (multi-turn and speculative stats are refused by the config)
        raise ValueError(f"a remote rollout worker sends single-turn rollouts only, not {type(rollout.stats).__name__}")
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
    return Message({"kind": "rollout", "step": step, "groups": fields, "stats": dataclasses.asdict(rollout.stats)},
                   tensors)


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
    return Rollout(Groups(**fields), RolloutStats(**message.header["stats"]))
