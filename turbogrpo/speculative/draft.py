"""The EAGLE-style draft head: a one-layer model that predicts the policy's next feature.

Alignment (the same as the policy's KV cache, so both caches share one geometry): the draft's input at
position ``s`` is the pair (policy feature ``f[s-1]``, token ``x[s]``), with ``f[-1] = 0`` for the
first prompt token. The pair is fused by a linear layer over the concatenation
``[embed(x[s]), f[s-1]]``, run through ``num_layers`` decoder layers of the policy's own class (built
from the policy's config, so any model the engine runs works), and the output ``g[s]`` is trained
to equal ``f[s]``; the policy's frozen LM head turns it into draft logits for ``x[s+1]``. While
drafting, the draft feeds its own predicted features back in place of the policy's.

Features are the policy's final (post-norm) hidden states, the input of its LM head.

The policy's embeddings and LM head are referenced, never copied: they are not parameters of the
draft and not in its saved file. The draft is saved as ``draft.safetensors`` + ``draft_config.json``.

Legend: B sequences, n tokens per sequence, Hd hidden size, V vocabulary.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from turbogrpo.hook import ATTENTION_NAME, PLAN_KWARG, check_supported, decoder_of, lm_head_of
from turbogrpo.rollout.plans import causal_attention

CONFIG_FILE = "draft_config.json"
WEIGHTS_FILE = "draft.safetensors"


@dataclass(frozen=True)
class DraftConfig:
    """What a saved draft needs besides its weights."""

    num_layers: int = 1
    """Decoder layers in the draft body (EAGLE uses 1: deeper drafts cost more than they gain)."""
    model_type: str = ""
    """The policy's model type, checked when the draft is attached to a policy."""
    hidden_size: int = 0
    """The policy's hidden size (the feature width)."""
    vocab_size: int = 0
    """The policy's vocabulary size."""

    def __post_init__(self):
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"draft num_layers must be an integer >= 1, got {self.num_layers!r}")


class PolicyParts(NamedTuple):
    """The policy modules the draft uses but does not own (a tuple, so nn.Module does not register them)."""

    embed_tokens: nn.Module
    lm_head: nn.Module


class DraftHead(nn.Module):
    """See the module docstring. Build with ``DraftHead(policy)`` or ``DraftHead.load(path, policy)``."""

    def __init__(self, policy: nn.Module, num_layers: int = 1):
        super().__init__()
        check_supported(policy)
        policy_config = policy.config
        self.config = DraftConfig(num_layers=num_layers, model_type=policy_config.model_type,
                                  hidden_size=policy_config.hidden_size, vocab_size=policy_config.vocab_size)
        decoder = decoder_of(policy)
        self.policy = PolicyParts(decoder.get_input_embeddings(), lm_head_of(policy))
        layer_config = _draft_layer_config(policy_config, num_layers)
        reference = next(decoder.parameters())
        hidden = policy_config.hidden_size
        self.fuse = nn.Linear(2 * hidden, hidden, bias=True)
        self.layers = nn.ModuleList(type(decoder.layers[0])(layer_config, layer_idx=i) for i in range(num_layers))
        self.fuse.to(device=reference.device, dtype=reference.dtype)
        self.layers.to(device=reference.device, dtype=reference.dtype)
        # RoPE frequencies stay float32, as in the policy.
        self.rotary = type(decoder.rotary_emb)(config=layer_config).to(reference.device)

    def forward(self, features_BnH: torch.Tensor, tokens_Bn: torch.Tensor, positions_Bn: torch.Tensor,
                plan: Callable) -> torch.Tensor:
        """Predicted features ``[B, n, Hd]`` for pairs (``features_BnH`` = f[s-1], ``tokens_Bn`` = x[s]) at
        ``positions_Bn``; every layer's attention is computed by ``plan`` (see ``turbogrpo.hook``)."""
        with torch.no_grad():  # the policy's embeddings are frozen here
            embedded = self.policy.embed_tokens(tokens_Bn)
        hidden = self.fuse(torch.cat([embedded, features_BnH.to(embedded.dtype)], dim=-1))
        rotary = self.rotary(hidden, positions_Bn)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=None, position_ids=positions_Bn, position_embeddings=rotary,
                           **{PLAN_KWARG: plan})
        return hidden

    def make_step(self, model: nn.Module, prompts: list[torch.Tensor], sampling):
        """The rollout engine's decoding step for ``generate(draft=self)``: ``Speculation(self)``'s."""
        # Imported here: decode.py builds on this module (the draft), not the other way round.
        from turbogrpo.speculative.decode import Speculation
        return Speculation(self).make_step(model, prompts, sampling)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., V]`` of the next token from predicted features ``[..., Hd]``.

        Gradients reach the features but never the policy's (frozen, shared) LM head.
        """
        head = self.policy.lm_head
        bias = None if head.bias is None else head.bias.detach()
        return F.linear(features, head.weight.detach(), bias)

    # -- persistence -----------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, directory / WEIGHTS_FILE)
        (directory / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=2))
        return directory

    @classmethod
    def load(cls, directory: str | Path, policy: nn.Module) -> "DraftHead":
        directory = Path(directory)
        if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
            raise ValueError(f"draft path {str(directory)!r} must be a folder with {CONFIG_FILE} and "
                             f"{WEIGHTS_FILE} (written by DraftHead.save)")
        config = DraftConfig(**json.loads((directory / CONFIG_FILE).read_text()))
        expected = (policy.config.model_type, policy.config.hidden_size, policy.config.vocab_size)
        if (config.model_type, config.hidden_size, config.vocab_size) != expected:
            raise ValueError(
                f"draft at {str(directory)!r} was trained for (model_type, hidden_size, vocab_size) = "
                f"{(config.model_type, config.hidden_size, config.vocab_size)}, but the policy has {expected}")
        draft = cls(policy, num_layers=config.num_layers)
        weights = load_file(directory / WEIGHTS_FILE, device=str(next(draft.parameters()).device))
        draft.load_state_dict(weights)
        return draft


def _draft_layer_config(policy_config, num_layers: int):
    """The policy's config, cut to ``num_layers`` layers that dispatch attention to turbogrpo plans."""
    import turbogrpo.hook  # noqa: F401  (registers the attention name the layers look up)

    config = copy.deepcopy(policy_config)
    layer_types = getattr(config, "layer_types", None)
    config.num_hidden_layers = num_layers
    if layer_types:
        config.layer_types = list(layer_types[:num_layers])
    config._attn_implementation = ATTENTION_NAME
    return config


class CausalPlan:
    """Causal attention over right-padded rows (training): padding sits after every real query."""

    def __call__(self, module, query, key, value, *, scaling, sliding_window):
        return causal_attention(query, key, value, scaling=scaling, sliding_window=sliding_window)


def shift_features(features_BTH: torch.Tensor) -> torch.Tensor:
    """Draft input features: ``f[s-1]`` at position s, zeros at s = 0."""
    return F.pad(features_BTH[:, :-1], (0, 0, 1, 0))


# -- training ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DraftTrainConfig:
    """Draft training hyper-parameters (EAGLE / FastGRPO defaults)."""

    feature_weight: float = 1.0
    """w_v, weight of SmoothL1(predicted feature, policy feature) (EAGLE 1.0, FastGRPO code 2.0)."""
    logit_weight: float = 0.1
    """w_p, weight of CE(draft logits, policy's next-token distribution)."""
    lr: float = 1e-4
    """AdamW learning rate (EAGLE and FastGRPO)."""
    weight_decay: float = 0.0
    """AdamW weight decay (EAGLE uses none)."""
    num_epochs: int = 1
    """Passes over the examples (offline training; online training makes one pass per rollout)."""
    batch_size: int = 8
    """Sequences per optimizer step."""
    max_grad_norm: float = 0.5
    """Gradient clipping (EAGLE's value); keeps early steps on random features stable."""

    def __post_init__(self):
        for name in ("lr", "batch_size", "num_epochs", "max_grad_norm"):
            if not getattr(self, name) > 0:
                raise ValueError(f"draft training {name} must be > 0, got {getattr(self, name)!r}")
        for name in ("feature_weight", "logit_weight", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"draft training {name} must be >= 0, got {getattr(self, name)!r}")


class DraftExample(NamedTuple):
    """One sequence to train on: a prompt and a completion, with the policy's features."""

    tokens: torch.Tensor    # [T] long: prompt then completion
    features: torch.Tensor  # [T, Hd]: the policy's final hidden state at every position
    loss_start: int         # first position whose prediction is trained (the first completion token)


@torch.no_grad()
def policy_features(policy: nn.Module, sequences: Sequence[torch.Tensor], *, batch_size: int = 8) -> list[torch.Tensor]:
    """The policy's final hidden state ``[T, Hd]`` at every position of each 1-D sequence."""
    decoder = decoder_of(policy)
    device = next(policy.parameters()).device
    features = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start:start + batch_size]
        ids, lengths = _pad(chunk, device)
        # Right padding and a causal mask: no real position sees padding, so no attention mask is needed.
        hidden = decoder(input_ids=ids).last_hidden_state
        features.extend(hidden[row, :length] for row, length in enumerate(lengths))
    return features


def draft_examples(policy: nn.Module, prompts: Sequence[torch.Tensor],
                   completions: Sequence[Sequence[torch.Tensor]]) -> list[DraftExample]:
    """Training examples from prompts and the policy's own completions (a list per prompt)."""
    sequences, starts = [], []
    for prompt, group in zip(prompts, completions):
        for completion in group:
            if len(completion) > 1:  # one-token completions have no position to learn from
                sequences.append(torch.cat([prompt.to(completion.device), completion]))
                starts.append(len(prompt))
    feats = policy_features(policy, sequences)
    return [DraftExample(seq, feat, start) for seq, feat, start in zip(sequences, feats, starts)]


def draft_loss(draft: DraftHead, batch: Sequence[DraftExample], config: DraftTrainConfig) -> tuple[torch.Tensor, dict]:
    """``w_v * SmoothL1(g, f) + w_p * CE(draft logits, policy distribution)`` over trained positions.

    Returns the loss and metrics (both terms and the draft's top-1 agreement with the policy).
    """
    device = next(draft.parameters()).device
    tokens, lengths = _pad([ex.tokens for ex in batch], device)
    width = tokens.shape[1]
    features = torch.stack([F.pad(ex.features.to(device), (0, 0, 0, width - len(ex.tokens))) for ex in batch])
    positions = torch.arange(width, device=device).expand_as(tokens)
    starts = torch.tensor([ex.loss_start for ex in batch], device=device)
    # Position s predicts f[s], whose next-token distribution is p(x[s+1]); the last position has no
    # next token in the data but its feature is still a valid target.
    trained = (positions >= starts[:, None]) & (positions < torch.tensor(lengths, device=device)[:, None])
    predicted = draft(shift_features(features), tokens, positions, CausalPlan())[trained]
    target = features[trained].to(predicted.dtype)
    feature_loss = F.smooth_l1_loss(predicted.float(), target.float())
    with torch.no_grad():
        target_probs = draft.logits(target).float().softmax(-1)
    draft_logprobs = draft.logits(predicted).float().log_softmax(-1)
    logit_loss = -(target_probs * draft_logprobs).sum(-1).mean()
    loss = config.feature_weight * feature_loss + config.logit_weight * logit_loss
    top1 = (draft_logprobs.argmax(-1) == target_probs.argmax(-1)).float().mean()
    return loss, {"loss": loss.detach(), "feature_loss": feature_loss.detach(), "logit_loss": logit_loss.detach(),
                  "top1_agreement": top1}


def make_optimizer(draft: DraftHead, config: DraftTrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(draft.parameters(), lr=config.lr, weight_decay=config.weight_decay)


def train_draft(draft: DraftHead, examples: Sequence[DraftExample], config: DraftTrainConfig = DraftTrainConfig(),
                *, optimizer: torch.optim.Optimizer | None = None, seed: int = 0,
                on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
    """Train ``draft`` on ``examples`` (the policy's parts get no gradient).

    Pass a persistent ``optimizer`` for online training across rollouts. Returns per-step metrics
    (floats); ``on_step(step, metrics)`` is called after every step (progress bars, logging).
    """
    optimizer = optimizer or make_optimizer(draft, config)
    generator = torch.Generator().manual_seed(seed)
    history = []
    for _ in range(config.num_epochs):
        order = torch.randperm(len(examples), generator=generator).tolist()
        for start in range(0, len(order), config.batch_size):
            _, metrics = _train_step(draft, [examples[i] for i in order[start:start + config.batch_size]],
                                     optimizer, config)
            history.append(metrics)
            if on_step is not None:
                on_step(len(history), metrics)
    return history


def _train_step(draft, batch, optimizer, config) -> tuple[torch.Tensor, dict]:
    loss, metrics = draft_loss(draft, batch, config)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(draft.parameters(), config.max_grad_norm)
    optimizer.step()
    # One host sync per step, for the metrics the caller logs.
    return loss, {name: float(value) for name, value in metrics.items()}


def _pad(sequences: Iterable[torch.Tensor], device) -> tuple[torch.Tensor, list[int]]:
    sequences = list(sequences)
    lengths = [len(s) for s in sequences]
    ids = torch.zeros(len(sequences), max(lengths), dtype=torch.long, device=device)
    for row, seq in enumerate(sequences):  # a loop over sequences when batching data, not per token
        ids[row, :len(seq)] = seq
    return ids, lengths
