"""What the remote rollout worker's security costs per step (issue 51): one weights version of SmolLM2-135M-Instruct
(every parameter, float32: a full fine-tune's version, the largest that travels) through the authenticated, encrypted
channel (``turbogrpo.train.worker.secure_channel``: AES-256-GCM records) against the same bytes over a plain TCP socket, both
over loopback in one process (a sender thread, the receiver here), alternated; plus the base weights' digest a LoRA
run's two sides compare once (``weight_ring.frozen_digest``). The per-step cost is set against SmolLM2 GRPO steps
measured before (``bench/results``: the shortest recorded, and the one of this CPU kind where there is one).

    python bench/remote_channel.py             # 5 versions each way
    python bench/remote_channel.py --quick     # 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS_DIR, interleaved_medians, print_table, write_results  # noqa: E402
from real_model import load_real_model  # noqa: E402

from turbogrpo.train.worker import wire  # noqa: E402
from turbogrpo.train.worker.secure_channel import Channel, read_exactly  # noqa: E402
from turbogrpo.train.worker.weight_ring import frozen_digest, trainable_parameters  # noqa: E402

STEPS = {"e2e_smollm2-zero-shot": "turbogrpo step, 8 x 8 x 128, float32",
         "async_grpo_gsm8k": "on-policy step (k = 0), 8 x 8 x 128, float32"}
"""Recorded SmolLM2 GRPO steps the cost is compared with: result file -> what it timed."""


def recorded_steps() -> list[dict]:
    """The step times of ``STEPS`` with the CPU that measured them."""
    found = []
    for name, what in STEPS.items():
        data = json.loads((RESULTS_DIR / f"{name}.json").read_text())
        if "shapes" in data:
            seconds = data["shapes"][0]["timings"]["turbogrpo"]["median_s"]
        else:
            seconds = next(v["step_s_median"] for v in data["variants"] if v["max_staleness"] == 0)
        found.append({"result": name, "what": what, "step_s": seconds, "cpu": data["machine"]["cpu"]})
    return found


class Pipe:
    """A loopback TCP connection: ``send(frame)`` on a thread, ``receive()`` here."""

    def __init__(self, secure: bool):
        server = socket.create_server(("127.0.0.1", 0))
        self.sender = socket.create_connection(server.getsockname())
        self.receiver, _ = server.accept()
        server.close()
        key_a, key_b = os.urandom(32), os.urandom(32)
        self.secure = secure
        self.out, self.into = Channel(self.sender, key_a, key_b), Channel(self.receiver, key_b, key_a)

    def version(self, message: wire.Message) -> None:
        """One weights version from the sender thread to here, encoded, sent, received, decoded."""
        thread = threading.Thread(target=self._send, args=(message,))
        thread.start()
        if self.secure:
            header, payload = self.into.receive()
        else:
            sizes = read_exactly(self.receiver, 16)
            header_bytes, payload_bytes = int.from_bytes(sizes[:8], "big"), int.from_bytes(sizes[8:], "big")
            header = read_exactly(self.receiver, header_bytes)
            payload = torch.empty(payload_bytes, dtype=torch.uint8)
            view, done = memoryview(payload.numpy()), 0
            while done < payload_bytes:
                done += self.receiver.recv_into(view[done:], payload_bytes - done)
        wire.decode(header, payload, torch.device("cpu"))
        thread.join()

    def _send(self, message: wire.Message) -> None:
        frame = wire.encode(message)
        if self.secure:
            self.out.send(frame.header, frame.payload)
        else:
            size = frame.payload.numel()
            self.sender.sendall(len(frame.header).to_bytes(8, "big") + size.to_bytes(8, "big") + frame.header)
            self.sender.sendall(memoryview(frame.payload.numpy()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeats = 2 if args.quick else 5
    load_before = list(os.getloadavg())
    model, _ = load_real_model()
    parameters = trainable_parameters(model)
    message = wire.Message({"kind": "weights", "version": 0}, parameters)
    num_bytes = sum(p.numel() * p.element_size() for p in parameters.values())
    pipes = {"plain TCP": Pipe(secure=False), "authenticated + encrypted": Pipe(secure=True)}
    timings = interleaved_medians({name: (lambda pipe=pipe: pipe.version(message)) for name, pipe in pipes.items()},
                                  repeats=repeats, warmup=1)
    for p in model.parameters():
        p.requires_grad_(False)  # a LoRA run's base: every weight of the model is frozen and digested
    start = time.perf_counter()
    frozen_digest(model)
    digest_s = time.perf_counter() - start
    plain, secure = (timings[name]["median_s"] for name in pipes)
    extra_s = secure - plain
    steps = recorded_steps()
    rows = [[name, timings[name]["median_s"], num_bytes / timings[name]["median_s"] / 1e9] for name in pipes]
    print_table(f"one weights version of SmolLM2-135M ({num_bytes / 1e6:.0f} MB), loopback", ["channel", "median s",
                                                                                              "GB/s"], rows)
    print_table("the security's cost per step against recorded SmolLM2 steps",
                ["step", "cpu", "step s", "extra s per version", "share"],
                [[s["result"], s["cpu"], s["step_s"], extra_s, extra_s / s["step_s"]] for s in steps])
    print(f"base weights' digest (LoRA runs, once per run on each side): {digest_s:.2f} s")
    write_results("remote_channel", {
        "shape": f"SmolLM2-135M-Instruct, every parameter in float32 ({num_bytes} bytes)", "repeats": repeats,
        "timings": timings, "extra_s_per_version": extra_s, "digest_s": digest_s,
        "steps": [{**s, "share_of_step": extra_s / s["step_s"]} for s in steps],
        "load_average": {"before": load_before, "after": list(os.getloadavg())},
        "note": "one version per GRPO step crosses (the policy's trainable parameters after each update); the "
                "digest is paid once per run"})


if __name__ == "__main__":
    main()
