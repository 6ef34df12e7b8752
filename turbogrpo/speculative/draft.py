"""The EAGLE-style draft head: a one-layer model that predicts the policy's next feature.

Alignment (the same as the policy's KV cache, so both caches share one geometry): the draft's input at
position ``s`` is the pair (policy feature ``f[s-1]``, token ``x[s]``), with ``f[-1] = 0`` for the
first prompt token. The pair is fused by a linear layer over the concatenation
``[embed(x[s]), f[s-1]]``, run through ``num_layers`` decoder layers of the policy's own class (built
from the policy's config, so any model the engine runs works; Llama layers of the policy's width for a hybrid,
``draft_body.py``), and the output ``g[s]`` is trained
to equal ``f[s]``; the policy's frozen LM head turns it into draft logits for ``x[s+1]``. While
drafting, the draft feeds its own predicted features back in place of the policy's.

Features are the policy's final (post-norm) hidden states, the input of its LM head. Training
(offline and online) lives in ``draft_training.py``.

Layouts (``DraftConfig.layout``, the table ``DRAFT_LAYOUTS``): "turbogrpo" (the default, as above),
"eagle3" and "eagle", vLLM's EAGLE drafter (``vllm/model_executor/models/llama_eagle.py``) exactly, so that
``export_vllm`` can hand the draft to vLLM: its fuse has no bias, its first layer no input norm (EAGLE-1's
choice; later layers keep theirs), and it never sees the first prompt token's pair (f[-1] = 0, x[0]), which
vLLM's drafter has no slot for. Its pairs then sit one position earlier (pair (f[s-1], x[s]) at position
s - 1, vLLM's), which RoPE does not see (attention depends on position differences only).

"eagle3" (EAGLE-3's features): the policy feature is wider, the outputs of a low, a middle and a high decoder
layer followed by the final feature, ``[f_low, f_mid, f_high, f]`` (``(k + 1) * Hd``, k =
``len(DraftConfig.feature_layers)``; the final feature stays last, so it is still the training target). A linear
layer without bias (``reduce``) maps it to ``Hd`` before the fuse; while drafting, the draft's own predicted
features replace the reduced one, as EAGLE-3 does. The rollout reads the tapped layers from the same policy
forwards that give the final features (``LayerTap``: forward hooks, no extra forward). Training the draft on its
own earlier predictions (``DraftLearningConfig.ttt_steps``, ``draft_training.py``) is what makes that
replacement work.

The policy's embeddings and LM head are referenced, never copied: they are not parameters of the
draft and not in its saved file. The draft is saved as ``draft.safetensors`` + ``draft_config.json``.

Draft vocabulary (``num_draft_tokens``): drafting may read only the LM head's rows of the tokens the
draft saw most in training (``set_draft_tokens``), as FR-Spec and EAGLE-3 do. On a small model with a
large vocabulary (SmolLM2: 49k rows x 576) reading the whole head at every tree level costs about a
third of a policy step; 4096 rows cost a twelfth of that. Tokens outside the subset get log-prob -inf
and are never proposed; verification is unchanged, so sampling stays exactly the policy's. Training
reads the same rows (``vocabulary_logits``): its target is the policy's distribution renormalised over
the draft vocabulary, which is the best a draft limited to it can propose (acceptance is then the
policy's mass on the vocabulary), at a twelfth of the whole head's cost per trained token.

Legend: B sequences, n tokens per sequence, Hd hidden size, V vocabulary.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from turbogrpo.files import save_tensors, write_text_atomically
from turbogrpo.hook import PLAN_KWARG, check_supported, decoder_of, lm_head_of, plan_mask
from turbogrpo.output_head import LogitsHead, logits_head
from turbogrpo.rollout.plans import causal_attention
from turbogrpo.speculative.draft_body import body_kind, build_draft_body, copyable, source_layer
from turbogrpo.speculative.tree import Proposals

CONFIG_FILE = "draft_config.json"
WEIGHTS_FILE = "draft.safetensors"


@dataclass(frozen=True)
class DraftLayout:
    """How a draft fuses its input and which prompt pairs it sees (module docstring)."""

    name: str
    fuse_bias: bool
    """Whether the fuse (the linear layer over ``[embed(x[s]), f[s-1]]``) has a bias."""
    first_layer_norm: bool
    """Whether the first decoder layer normalizes its input (its ``input_layernorm``)."""
    context_start: int
    """The first prompt position whose pair the draft sees (1: it never sees (f[-1] = 0, x[0]))."""
    feature_layers: Callable[[int], tuple[int, ...]] = lambda num_layers: ()
    """The policy's decoder layers (by index, given its number of layers) whose outputs the draft reads
    besides the final feature; none: the final feature alone."""


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers: it reads the hidden states entering layers 2, L // 2 and L - 3,
    the outputs of layers 1, L // 2 - 1 and L - 4 (SmolLM2's 30: 1, 14, 26); clamped and distinct on a policy
    of few layers (a 2-layer test model: 0 and 1)."""
    return tuple(sorted({min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4)}))


DRAFT_LAYOUTS: dict[str, DraftLayout] = {layout.name: layout for layout in (
    DraftLayout("turbogrpo", fuse_bias=True, first_layer_norm=True, context_start=0),
    DraftLayout("eagle", fuse_bias=False, first_layer_norm=False, context_start=1),
    DraftLayout("eagle3", fuse_bias=True, first_layer_norm=True, context_start=0, feature_layers=eagle3_layers),
)}
"""DraftConfig.layout -> its layout."""


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
    num_draft_tokens: int = 0
    """Tokens drafting may propose (the LM head rows it reads; see the module docstring); 0: all."""
    layout: str = "turbogrpo"
    """A name in ``DRAFT_LAYOUTS`` ("eagle": vLLM's EAGLE drafter exactly, exportable to vLLM; "eagle3": several
    of the policy's layers)."""
    feature_layers: tuple[int, ...] = ()
    """The policy's decoder layers whose outputs the draft reads before the final feature (its layout's
    choice for the policy it was built for; empty for "turbogrpo" and "eagle")."""

    def __post_init__(self):
        if self.layout not in DRAFT_LAYOUTS:
            raise ValueError(f"draft layout must be one of {sorted(DRAFT_LAYOUTS)}, got {self.layout!r}")
        object.__setattr__(self, "feature_layers", tuple(self.feature_layers))  # JSON gives a list
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.feature_layers):
            raise ValueError(f"draft feature_layers must be layer indices >= 0, got {list(self.feature_layers)}")
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"draft num_layers must be an integer >= 1, got {self.num_layers!r}")
        if (isinstance(self.num_draft_tokens, bool) or not isinstance(self.num_draft_tokens, int)
                or self.num_draft_tokens < 0):
            raise ValueError(f"draft num_draft_tokens must be an integer >= 0, got {self.num_draft_tokens!r}")


class PolicyParts(NamedTuple):
    """The policy modules the draft uses but does not own (a tuple, so nn.Module does not register them)."""

    embed_tokens: nn.Module
    lm_head: nn.Module
    head: LogitsHead    # lm_head and the transforms the policy's forward applies to its logits
    layers: nn.ModuleList  # the policy's decoder layers, which a LayerTap reads ("eagle3")


class LayerTap:
    """The outputs ``[B, T, Hd]`` of some of the policy's decoder layers at its latest forward.

    Forward hooks keep a reference to each tapped layer's output (no copy), so the rollout's own forwards
    (prefill, plain steps, tree verification) give the "eagle3" features with no forward of their own. The
    hooks hold the tap weakly, and ``close`` (or leaving the ``with`` block) removes them; a tap dropped
    without closing removes its hooks as it is collected."""

    def __init__(self, layers: nn.ModuleList, indices: tuple[int, ...]):
        self.indices = indices
        self.outputs: dict[int, torch.Tensor] = {}
        this = weakref.ref(self)
        self._handles = [layers[i].register_forward_hook(functools.partial(_keep_output, this, i)) for i in indices]

    def features(self, final: torch.Tensor) -> torch.Tensor:
        """The policy features ``[..., (k + 1) * Hd]`` of the latest forward: its tapped layers' outputs, then
        ``final`` (its final features ``[..., Hd]``, of the same forward)."""
        tapped = [self.outputs[i] for i in self.indices]
        assert all(t.shape == final.shape for t in tapped), "the tap's latest forward is not final's"
        return torch.cat([*(t.to(final.dtype) for t in tapped), final], dim=-1)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self.outputs = [], {}

    def __enter__(self) -> "LayerTap":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()


def _keep_output(tap: "weakref.ref[LayerTap]", index: int, module: nn.Module, args, output) -> None:
    live = tap()
    if live is not None:
        live.outputs[index] = output[0] if isinstance(output, tuple) else output


class DraftHead(nn.Module):
    """See the module docstring. Build with ``DraftHead(policy)`` or ``DraftHead.load(path, policy)``."""

    def __init__(self, policy: nn.Module, num_layers: int = 1, num_draft_tokens: int = 0, layout: str = "turbogrpo",
                 feature_layers: tuple[int, ...] | None = None):
        """``feature_layers``: the policy layers an "eagle3" draft reads (None: its layout's choice; a saved draft
        passes its own)."""
        super().__init__()
        check_draftable(policy)
        policy_config = policy.config
        decoder = decoder_of(policy)
        if layout in DRAFT_LAYOUTS and feature_layers is None:
            feature_layers = DRAFT_LAYOUTS[layout].feature_layers(len(decoder.layers))
        self.config = DraftConfig(num_layers=num_layers, model_type=policy_config.model_type,
                                  hidden_size=policy_config.hidden_size, vocab_size=policy_config.vocab_size,
                                  num_draft_tokens=num_draft_tokens, layout=layout,
                                  feature_layers=tuple(feature_layers or ()))
        self.layout = DRAFT_LAYOUTS[layout]
        if bool(self.config.feature_layers) != bool(self.layout.feature_layers(len(decoder.layers))) or \
                any(i >= len(decoder.layers) for i in self.config.feature_layers):
            raise ValueError(f"draft feature_layers {list(self.config.feature_layers)} do not fit layout {layout!r} "
                             f"on a policy of {len(decoder.layers)} layers")
        self.policy = PolicyParts(decoder.get_input_embeddings(), lm_head_of(policy), logits_head(policy),
                                  decoder.layers)
        reference = next(decoder.parameters())
        hidden = policy_config.hidden_size
        if self.config.feature_layers:  # "eagle3": the tapped layers and the final feature, reduced to one
            self.reduce = nn.Linear(self.feature_width, hidden, bias=False).to(device=reference.device,
                                                                               dtype=reference.dtype)
        self.fuse = nn.Linear(2 * hidden, hidden, bias=self.layout.fuse_bias)
        # The policy's own layer class, or Llama layers of its width for a hybrid (draft_body.py); RoPE
        # frequencies stay float32, as in the policy.
        self.layers, self.rotary, self.body_kind = build_draft_body(policy, num_layers)
        if not self.layout.first_layer_norm:
            self.layers[0].input_layernorm = nn.Identity()
        self.fuse.to(device=reference.device, dtype=reference.dtype)
        if num_draft_tokens:  # [Vd] token ids, saved with the weights; set_draft_tokens fills them
            self.register_buffer("draft_token_ids", torch.arange(num_draft_tokens, device=reference.device))
        self._head_rows_key, self._head_rows = None, None  # the head's draft-vocabulary rows, kept (_draft_head_rows)

    @property
    def feature_width(self) -> int:
        """Width of the policy features the draft reads: ``Hd``, or ``(k + 1) * Hd`` with k tapped layers."""
        return (len(self.config.feature_layers) + 1) * self.config.hidden_size

    def input_features(self, policy_features: torch.Tensor) -> torch.Tensor:
        """The draft's input features ``[..., Hd]`` from the policy's ``[..., feature_width]`` (f[s-1], already
        shifted): themselves, or "eagle3"'s reduction of the tapped layers and the final feature."""
        if policy_features.shape[-1] != self.feature_width:
            raise ValueError(f"the draft reads policy features of width {self.feature_width} (layers "
                             f"{list(self.config.feature_layers)} and the final one), got {policy_features.shape[-1]}")
        if not self.config.feature_layers:
            return policy_features
        return self.reduce(policy_features.to(self.reduce.weight.dtype))

    def feature_tap(self) -> LayerTap | None:
        """A tap on the policy layers this draft reads (close it after use); None when it reads the final
        features only."""
        return LayerTap(self.policy.layers, self.config.feature_layers) if self.config.feature_layers else None

    def forward(self, features_BnH: torch.Tensor, tokens_Bn: torch.Tensor, positions_Bn: torch.Tensor,
                plan: Callable) -> torch.Tensor:
        """Predicted features ``[B, n, Hd]`` for pairs (``features_BnH`` = f[s-1], ``tokens_Bn`` = x[s]) at
        ``positions_Bn``; every layer's attention is computed by ``plan`` (see ``turbogrpo.hook``)."""
        with torch.no_grad():  # the policy's embeddings are frozen here
            embedded = self.policy.embed_tokens(tokens_Bn)
        hidden = self.fuse(torch.cat([embedded, features_BnH.to(embedded.dtype)], dim=-1))
        rotary = self.rotary(hidden, positions_Bn)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=plan_mask(plan, hidden.device), position_ids=positions_Bn,
                           position_embeddings=rotary, **{PLAN_KWARG: plan})
        return hidden

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., V]`` of the next token from predicted features ``[..., Hd]``.

        Gradients reach the features but never the policy's (frozen, shared) LM head. The policy's own
        logit transforms apply (Granite's scaling, Gemma's soft-cap: ``turbogrpo.output_head``), so the draft
        proposes from, and is trained towards, the distribution the policy samples from.
        """
        head = self.policy.lm_head
        bias = None if head.bias is None else head.bias.detach()
        return self.policy.head.transform(F.linear(features, head.weight.detach(), bias))

    def vocabulary_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over the tokens drafting may propose: ``[..., Vd]`` in ``draft_token_ids`` order when there
        is a draft vocabulary, else ``[..., V]`` (``logits``). Gradients reach the features only."""
        if not self.config.num_draft_tokens:
            return self.logits(features)
        weight, bias = self._draft_head_rows()
        return self.policy.head.transform(F.linear(features, weight, bias))   # elementwise: any rows

    def proposals(self, features: torch.Tensor) -> torch.Tensor | Proposals:
        """What drafting proposes from predicted features ``[..., Hd]``: log-probs (float32) of the next
        token over the draft vocabulary (``Proposals``) when there is one, else ``[..., V]`` over all of it."""
        logprobs = self.vocabulary_logits(features).float().log_softmax(-1)             # [..., Vd]
        return Proposals(logprobs, self.draft_token_ids) if self.config.num_draft_tokens else logprobs

    def draft_logprobs(self, features: torch.Tensor) -> torch.Tensor:
        """Drafting's log-probs ``[..., V]`` (float32) of the next token from predicted features ``[..., Hd]``:
        over the draft vocabulary when there is one (other tokens -inf), else over all of it."""
        proposals = self.proposals(features)
        if not isinstance(proposals, Proposals):
            return proposals
        subset = proposals.logprobs
        full = subset.new_full((*subset.shape[:-1], self.policy.lm_head.weight.shape[0]), float("-inf"))
        return full.scatter_(-1, proposals.token_ids.expand(subset.shape), subset)

    def _draft_head_rows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head's rows of the draft vocabulary, weight ``[Vd, Hd]`` and bias ``[Vd]`` or None.

        Drafting asks at every tree level; gathering them each time cost about as much as the level's
        matmul (4096 x 576 float32, 8 rows, one CPU thread, timed by hand: 2.9-3.3 ms with the gather,
        1.6-1.9 ms without), so
        they are kept until the head's or the ids' storage or version changes (an optimizer step on
        the policy bumps the weight's version)."""
        head, ids_Vd = self.policy.lm_head, self.draft_token_ids
        key = tuple((t.data_ptr(), t._version) for t in (head.weight, ids_Vd, head.bias) if t is not None)
        if self._head_rows_key != key:
            bias = None if head.bias is None else head.bias.detach().index_select(0, ids_Vd)
            self._head_rows = head.weight.detach().index_select(0, ids_Vd), bias
            self._head_rows_key = key
        return self._head_rows

    @torch.no_grad()
    def init_from_policy(self) -> int:
        """Copy a late policy layer into every draft layer where names, shapes and module kinds agree
        (``draft_body.copyable``): the policy's last layer for an attention model (all of it but the input norm an
        "eagle" draft's first layer drops); a hybrid's last full-attention layer as far as it is a Llama layer (its
        projections and MLP where their shapes agree), with a warning naming what keeps its random init. Returns the
        tensors copied. The draft's layer then starts as the policy's best guess of a late transformation, not a
        random one."""
        copied, missed = 0, []
        for layer in self.layers:
            source = source_layer(self.policy.layers, layer)
            same, other = copyable(layer, source)
            source_tensors, tensors = source.state_dict(), layer.state_dict()
            for name in same:
                tensors[name].copy_(source_tensors[name])
            copied += len(same)
            missed += [name for name in other if name not in missed]
        if missed:
            warnings.warn(f"draft init_from_policy: the {self.config.model_type} policy's layers have nothing of the "
                          f"same kind and shape for {', '.join(missed)} (kept random); copied {copied} tensors",
                          UserWarning, stacklevel=3)   # past torch.no_grad's wrapper
        return copied

    def set_draft_tokens(self, token_ids: torch.Tensor) -> None:
        """Make ``token_ids`` ``[Vd]`` (distinct ids, Vd = ``config.num_draft_tokens``) the draft vocabulary."""
        if not self.config.num_draft_tokens or token_ids.shape != self.draft_token_ids.shape:
            raise ValueError(f"draft tokens: expected {self.config.num_draft_tokens} ids (num_draft_tokens), got "
                             f"{tuple(token_ids.shape)}")
        if len(torch.unique(token_ids)) != len(token_ids):
            raise ValueError("draft tokens must be distinct")
        self.draft_token_ids.copy_(token_ids)

    # -- persistence -----------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """Write ``draft.safetensors`` and ``draft_config.json`` into ``directory``, each whole or not at all
        (temporary files renamed into place; the config, which makes the folder a draft, goes last)."""
        directory = Path(directory)
        not_finite = [name for name, tensor in self.state_dict().items()
                      if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]  # host sync
        if not_finite:
            raise ValueError(f"not saving the draft to {directory}: its weights are not finite (inf/NaN in "
                             f"{', '.join(not_finite[:3])}{' ...' if len(not_finite) > 3 else ''}); training "
                             "diverged: lower the learning rate and train it again")
        directory.mkdir(parents=True, exist_ok=True)
        weights_tmp = directory / f".{WEIGHTS_FILE}.tmp"
        save_tensors(self.state_dict(), weights_tmp)
        os.replace(weights_tmp, directory / WEIGHTS_FILE)
        write_text_atomically(directory / CONFIG_FILE, json.dumps(asdict(self.config), indent=2))
        return directory

    @classmethod
    def load(cls, directory: str | Path, policy: nn.Module) -> "DraftHead":
        """The draft saved in ``directory``, attached to ``policy``; a ValueError naming the file when the
        folder is not a draft, was trained for another policy, or its files are damaged or disagree."""
        directory = Path(directory)
        if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
            raise ValueError(f"draft path {str(directory)!r} must be a folder with {CONFIG_FILE} and "
                             f"{WEIGHTS_FILE} (written by DraftHead.save)")
        config = _read_config(directory / CONFIG_FILE)
        expected = (policy.config.model_type, policy.config.hidden_size, policy.config.vocab_size)
        if (config.model_type, config.hidden_size, config.vocab_size) != expected:
            raise ValueError(
                f"draft at {str(directory)!r} was trained for (model_type, hidden_size, vocab_size) = "
                f"{(config.model_type, config.hidden_size, config.vocab_size)}, but the policy has {expected}")
        draft = cls(policy, num_layers=config.num_layers, num_draft_tokens=config.num_draft_tokens,
                    layout=config.layout, feature_layers=config.feature_layers)
        weights_file = directory / WEIGHTS_FILE
        try:
            weights = load_file(weights_file, device=str(next(draft.parameters()).device))
        except SafetensorError as err:
            raise ValueError(f"draft weights {str(weights_file)!r} are truncated or corrupt ({err}); train the "
                             "draft again (`turbogrpo draft train`) or copy it again") from None
        problem = _mismatch(draft.state_dict(), weights)
        if problem:
            raise ValueError(f"draft {str(directory)!r}: {WEIGHTS_FILE} does not match {CONFIG_FILE} "
                             f"({config.num_layers} layers for this policy): {problem}; save the two files together "
                             "(DraftHead.save) or train the draft again")
        draft.load_state_dict(weights)
        return draft


def saved_layout(directory: str | Path) -> str:
    """The layout of the draft saved in ``directory`` (a ValueError naming the file when it is not a draft)."""
    return _read_config(Path(directory) / CONFIG_FILE).layout


def _read_config(path: Path) -> DraftConfig:
    """The DraftConfig in ``path``; a ValueError naming the file for bad JSON or unknown or bad fields."""
    try:
        fields = json.loads(path.read_text())
        if not isinstance(fields, dict):
            raise TypeError(f"it holds {type(fields).__name__}, not a JSON object")
        return DraftConfig(**fields)
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, ValueError) as err:
        raise ValueError(f"draft config {str(path)!r} is not valid ({err}); it should be the {CONFIG_FILE} "
                         "DraftHead.save wrote") from None


def _mismatch(expected: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> str | None:
    """What differs between a state dict's tensor names and shapes and loaded ``weights`` (None: nothing)."""
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    reshaped = [f"{k} is {tuple(weights[k].shape)}, expected {tuple(expected[k].shape)}"
                for k in sorted(expected.keys() & weights.keys()) if weights[k].shape != expected[k].shape]
    problems = ([f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"] if missing else []) + \
               ([f"unexpected {', '.join(unexpected[:3])}{' ...' if len(unexpected) > 3 else ''}"] if unexpected
                else []) + reshaped[:3]
    return "; ".join(problems) or None


def check_draftable(policy: nn.Module) -> None:
    """ValueError unless ``policy`` is a decoder the draft can follow: pure attention with rotary positions and a
    ``layers`` list (Qwen2/Qwen3/Llama/Mistral), whose layer class the draft copies, not GPT-2's absolute
    positions; or a hybrid the native engine samples (``architectures.SHARED_IN_TRAINING``), for which the draft
    runs Llama layers of its width (``draft_body``) and proposes chains (its recurrent states follow one path)."""
    check_supported(policy, training=True)
    decoder = decoder_of(policy)
    rotary_needed = body_kind(policy) == "policy"
    if not isinstance(getattr(decoder, "layers", None), nn.ModuleList) or \
            (rotary_needed and getattr(decoder, "rotary_emb", None) is None):
        model_type = getattr(policy.config, "model_type", type(policy).__name__)
        raise ValueError(f"model type {model_type!r} has no rotary-position decoder layers (model.layers and "
                         "rotary_emb) for a draft head to copy; speculative rollouts need a Qwen2/Qwen3/Llama/"
                         "Mistral-style model: set rollout.speculation = \"off\" (or generate without draft=)")


class CausalPlan:
    """Causal attention over right-padded rows (training): padding sits after every real query."""

    def __call__(self, module, query, key, value, *, scaling, sliding_window):
        return causal_attention(query, key, value, scaling=scaling, sliding_window=sliding_window)

    def recurrent_layout(self) -> None:
        """None: every row is one whole sequence from position 0, which a hybrid policy's recurrent layers run
        through their own forward (right padding follows every real token, so it never reaches one)."""
        return None


def shift_features(features_BTH: torch.Tensor) -> torch.Tensor:
    """Draft input features: ``f[s-1]`` at position s, zeros at s = 0."""
    return F.pad(features_BTH[:, :-1], (0, 0, 1, 0))


def check_prompt_lengths(lengths: list[int], context_start: int) -> None:
    """ValueError unless every prompt keeps a pair for a draft that skips its first ``context_start`` pairs."""
    if min(lengths) <= context_start:
        raise ValueError(f"a draft that skips the first {context_start} prompt pair(s) (layout \"eagle\") needs "
                         f"prompts of at least {context_start + 1} tokens, got one of {min(lengths)}")


def prompt_pairs(prompt_P: torch.Tensor, features_PH: torch.Tensor, context_start: int = 0,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt pairs a draft sees from ``context_start`` on (its layout's): tokens ``[P']`` and their input
    features ``[P', Hd]`` (f[s-1], zeros at s = 0), P' = P - context_start."""
    check_prompt_lengths([len(prompt_P)], context_start)
    return prompt_P[context_start:], shift_features(features_PH[None])[0][context_start:]
