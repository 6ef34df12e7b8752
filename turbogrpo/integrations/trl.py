"""TRL's ``GRPOTrainer`` with turbogrpo's shared-prefix training forward, in one line.

    from turbogrpo.integrations.trl import SharedPrefixGRPOTrainer
    trainer = SharedPrefixGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)

or, for a trainer that is already built (a ``GRPOTrainer`` or any subclass of it):

    from turbogrpo.integrations.trl import enable_shared_prefix
    enable_shared_prefix(trainer)

What changes: TRL's per-token log-prob computation (``_get_per_token_logps_and_entropies``: policy with
entropy, old policy, reference) runs each distinct prompt of a batch once for all of its completions,
with the same values and gradients. Everything else stays TRL's: generation (its vLLM included),
rewards, advantages, every ``loss_type``, ``beta``, ``num_iterations``, ``steps_per_generation``,
gradient accumulation, PEFT adapters, and TRL's mixed precision (a float32 model under bf16 autocast,
its default: the shared forward runs under the same ``accelerator.autocast()``).

Groups come from the tokens, never from an assumed layout: rows whose real (left-padded) prompt
tokens are identical share one prompt forward, wherever they sit in the batch. TRL shuffles the rows
of a generation batch before cutting it into micro-batches, so a micro-batch often holds part of a
group; the members present still share. Calls that cannot share run TRL's own code, and the trainer
logs each reason once (``trainer.shared_prefix_stats`` counts both kinds of call). One such reason is a
model with absolute position embeddings (GPT-2) and left-padded prompts: TRL counts the padding in
the positions, so only TRL's own forward reproduces TRL's log-probs. Hybrid models (``turbogrpo.mixers``) share
too; one whose recurrent or convolution layers carry a left pad into their state (a bias on their input
projection, ``MixerUnit.padding_reaches_state``) runs TRL's own forward on left-padded batches, for the same reason.

Multi-turn rows (``tools=``, ``environment_factory=``, a ``rollout_func`` returning ``env_mask``) need
nothing of their own. TRL puts a row's every turn in its completion: the model's tokens and the tool or
environment replies between them, the replies marked 0 in ``tool_mask``. The attention mask TRL passes
covers the whole completion, so the shared forward sees the replies as context and scores every completion
token, as TRL's forward does; TRL's loss, entropy and KL then multiply in ``tool_mask``, so reply tokens
never reach them (tested in ``tests/integrations/test_trl_tools.py``). Prompt sharing shares only the
prompt: an ``environment_factory`` whose ``reset`` observation differs per rollout makes every prompt
differ (then TRL's own forward runs), and members whose first turns coincide share more than the prompt.

Tree sharing uses that too. With ``sharing="tree"`` (or ``"auto"``, the default, when it saves tokens) a
call's rows become one trie (``turbogrpo.tree``): each row is its real prompt tokens then its real completion
tokens, cut by TRL's attention mask (never by token values: with pad == eos, TRL #4974, a completion's
closing EOS is a pad id too) and never re-tokenised, so rows whose completions begin alike (the same first
turn, the same tool reply) run their common tokens once. Every completion token is scored, tool replies
included, as TRL's forward does; ``tool_mask`` still does the masking in TRL's loss. ``sharing="prompt"``
shares the prompt only. The choice is the constructor's ``sharing`` argument (or ``enable_shared_prefix``'s).

Moving a run to turbogrpo's own trainer: ``off_policy_correction_of(args)`` gives the ``algo.*`` settings
that correct rollouts as the ``GRPOConfig`` does (``vllm_importance_sampling_mode`` under the same name, its
bounds as ``tis_cap`` and ``tis_cap_low``).

Shape legend: B rows (one completion each), P prompt columns (left-padded), C completion columns
(right-padded), L = P + C.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass, field

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch import nn

from turbogrpo.batch import Groups
from turbogrpo.hook import check_supported, has_absolute_positions, lm_head_of
from turbogrpo.mixers import padding_reaches_state
from turbogrpo.output_head import check_logits_head
from turbogrpo.prefix import compute_logprobs
from turbogrpo.tree import tree_logprobs, trie_of_groups

try:
    import trl
    from trl import GRPOTrainer
except ImportError as err:  # pragma: no cover - exercised only without TRL
    raise ImportError("turbogrpo.integrations.trl needs TRL; install it with pip install 'trl>=1.16,<2'") from err

logger = logging.getLogger(__name__)

# TRL 1.16 introduced the fused-LM-head `_get_per_token_logps_and_entropies` this module replaces; a
# 2.x may change it again. Tested with 1.16.0.
SUPPORTED_TRL = SpecifierSet(">=1.16,<2")
PATCHED_METHOD = "_get_per_token_logps_and_entropies"
PATCHED_PARAMETERS = ("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
                      "compute_aux_loss")


def check_trl_version(version: str | None = None) -> None:
    """Raise ValueError unless ``version`` (default: the installed TRL) is one this drop-in supports."""
    version = trl.__version__ if version is None else version
    if not SUPPORTED_TRL.contains(Version(version), prereleases=True):
        raise ValueError(f"turbogrpo.integrations.trl supports TRL {SUPPORTED_TRL} (tested with 1.16.0), but "
                         f"trl {version} is installed; install a supported one: pip install 'trl{SUPPORTED_TRL}'")
    method = getattr(GRPOTrainer, PATCHED_METHOD, None)
    parameters = inspect.signature(method).parameters if method is not None else {}
    missing = [name for name in PATCHED_PARAMETERS if name not in parameters]
    if missing:
        raise ValueError(f"trl {version}'s GRPOTrainer.{PATCHED_METHOD} lacks {missing}, which "
                         f"turbogrpo.integrations.trl replaces; install trl 1.16 (pip install 'trl>=1.16,<1.17')")


@dataclass
class SharedPrefixStats:
    """What the drop-in did, call by call (read it as ``trainer.shared_prefix_stats``)."""

    num_shared_calls: int = 0        # log-prob calls run through the shared-prefix forward
    num_fallback_calls: int = 0      # calls handed to TRL's own code
    num_rows: int = 0                # completions scored by shared calls
    num_prompt_forwards: int = 0     # prompts those calls ran (one per group found)
    num_partial_groups: int = 0      # groups with fewer than num_generations members in their batch
    num_tree_calls: int = 0          # shared calls (or chunks of one) whose rows ran as one trie
    num_tokens_run: int = 0          # tokens the shared forwards ran
    num_row_tokens: int = 0          # tokens TRL's forward would have run for the same rows (real tokens only)
    fallback_reasons: dict[str, int] = field(default_factory=dict)  # reason -> number of calls


class NotShareable(ValueError):
    """A batch whose layout the shared forward cannot take; the message says why."""


def group_rows(prompt_ids_BP: torch.Tensor, prompt_mask_BP: torch.Tensor, completion_ids_BC: torch.Tensor,
               completion_mask_BC: torch.Tensor) -> tuple[Groups, list[int]]:
    """Group the rows of a TRL batch by their real prompt tokens: the groups (``Groups`` of the real
    prompt and completion tokens) and, per completion in their flat order, its row of the batch.

    Checks TRL's layout on the tokens themselves: prompt masks left-padded (zeros, then ones) and
    completion masks right-padded (ones, then zeros). Rows whose completion mask is all zeros (TRL's
    ``mask_truncated_completions``) score nothing and join no group. Raises :class:`NotShareable`.
    """
    prompt_mask_BP, completion_mask_BC = prompt_mask_BP.bool(), completion_mask_BC.bool()
    prompt_key_BP = prompt_ids_BP.masked_fill(~prompt_mask_BP, -1)
    _, group_of_row_B = torch.unique(prompt_key_BP, dim=0, return_inverse=True)  # host sync (CUDA): output size
    left_padded_B = (prompt_mask_BP[:, 1:] >= prompt_mask_BP[:, :-1]).all(dim=1)
    right_padded_B = (completion_mask_BC[:, 1:] <= completion_mask_BC[:, :-1]).all(dim=1)
    per_row = torch.stack([group_of_row_B, prompt_mask_BP.sum(1), completion_mask_BC.sum(1), left_padded_B,
                           right_padded_B], dim=1).tolist()  # host sync: the layout, read once per call
    num_columns = prompt_ids_BP.shape[1]
    members: dict[int, list[int]] = {}
    for row, (group, prompt_len, completion_len, left_padded, right_padded) in enumerate(per_row):
        if not left_padded or prompt_len == 0:
            raise NotShareable(f"row {row}'s prompt mask is not left padding before at least one token")
        if not right_padded:
            raise NotShareable(f"row {row}'s completion mask has a hole (it is not right padding)")
        if completion_len > 0:
            members.setdefault(group, []).append(row)
    if not members:
        raise NotShareable("no row has a completion token")
    if all(len(rows) == 1 for rows in members.values()):
        raise NotShareable("no two rows of the batch share a prompt (groups split across micro-batches, or "
                           "prompts that differ within a group, e.g. per-rollout environment observations), so "
                           "there is nothing to share")
    groups = list(members.values())
    rows = [r for g in groups for r in g]
    batch = Groups([prompt_ids_BP[g[0], num_columns - per_row[g[0]][1]:] for g in groups],
                   [completion_ids_BC[r, :per_row[r][2]] for r in rows], [len(g) for g in groups])
    return batch, rows


def split_groups(groups: Groups, rows: list[int], max_rows: int | None) -> list[tuple[Groups, list[int]]]:
    """Whole groups, gathered into chunks of at most ``max_rows`` rows (a larger group is a chunk of
    its own), each with its completions' rows: TRL's ``batch_size`` bounds the rows of one forward,
    and so its memory."""
    if max_rows is None:
        return [(groups, rows)]
    bounds, rows_in_chunk = [0], 0
    for end, size in enumerate(groups.sizes):
        if rows_in_chunk and rows_in_chunk + size > max_rows:
            bounds.append(end)
            rows_in_chunk = 0
        rows_in_chunk += size
    bounds.append(groups.num_groups)
    return [(groups.select(range(start, stop)), rows[groups.offsets[start]:groups.offsets[stop]])
            for start, stop in zip(bounds, bounds[1:])]


def scatter_index(groups: Groups, rows: list[int], num_columns: int) -> torch.Tensor:
    """``[Nq]`` flat positions in a ``[B, C]`` tensor of the groups' completion tokens, in the order
    ``compute_logprobs`` returns them (Groups order: group by group, member by member); ``rows``: each
    completion's row."""
    return torch.cat([torch.arange(length) + row * num_columns for row, length in zip(rows, groups.lengths)])


# ---------------------------------------------------------------- when TRL's own code must run

def _wrapped(trainer, model, **_) -> str | None:
    if trainer.accelerator.unwrap_model(model) is not model:
        return (f"the model is wrapped as {type(model).__name__} (distributed training or torch.compile); the "
                "shared forward calls its decoder directly, which would bypass the wrapper")
    return None


def _not_attention(trainer, model, **_) -> str | None:
    try:
        check_supported(model, training=True)   # a hybrid of architectures.SHARED_IN_TRAINING shares too
    except ValueError as err:
        return str(err)
    return None


def _not_plain_lm(trainer, model, **_) -> str | None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if base.config.get_text_config() is not base.config:
        return f"{type(base).__name__} is a multimodal model"
    if type(lm_head_of(model)) is not nn.Linear:
        return (f"the LM head is a {type(lm_head_of(model)).__name__} (an adapter on lm_head?); TRL scores "
                "with its raw weight")
    return None


def _multimodal_inputs(trainer, model, *, extra_inputs, **_) -> str | None:
    present = sorted(name for name, value in extra_inputs.items() if value is not None)
    return f"the batch has multimodal inputs ({', '.join(present)})" if present else None


def _aux_loss(trainer, model, *, compute_aux_loss, **_) -> str | None:
    return "the MoE load-balancing loss is asked for" if compute_aux_loss else None


def _entropy_bonus(trainer, model, *, compute_entropy, **_) -> str | None:
    if compute_entropy and getattr(trainer, "_entropy_bonus_enabled", False):
        return ("the entropy bonus (entropy_coef / adaptive entropy) differentiates the entropy, which "
                "turbogrpo returns as a detached metric")
    return None


# Each check returns why a call cannot share, or None. Order: cheapest and most common first.
CALL_CHECKS = (_multimodal_inputs, _aux_loss, _entropy_bonus, _wrapped, _not_attention, _not_plain_lm)


def shareable_groups(trainer, model, input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor,
                     logits_to_keep: int, **call) -> tuple[Groups, list[int]]:
    """The groups of one of TRL's log-prob calls, or :class:`NotShareable` saying why it cannot share."""
    for check in CALL_CHECKS:
        reason = check(trainer, model, **call)
        if reason is not None:
            raise NotShareable(reason)
    num_prompt_columns = input_ids_BL.shape[1] - logits_to_keep
    # Host sync (only for absolute-position models): whether any prompt is left-padded.
    if has_absolute_positions(model) and not bool(attention_mask_BL[:, :num_prompt_columns].all()):
        raise NotShareable("the model has absolute position embeddings and the batch left-pads its prompts: "
                           "TRL's forward counts the padding in every token's position, the shared forward starts "
                           "at the first real token, so their log-probs would differ")
    # Host sync (only for such hybrids): the same question.
    if padding_reaches_state(model) and not bool(attention_mask_BL[:, :num_prompt_columns].all()):
        raise NotShareable("the model's recurrent or convolution layers carry the left padding of the batch's "
                           "prompts into their state (a bias on their input projection): TRL's forward counts it, "
                           "the shared forward starts at the first real token, so their log-probs would differ")
    return group_rows(input_ids_BL[:, :num_prompt_columns], attention_mask_BL[:, :num_prompt_columns],
                      input_ids_BL[:, num_prompt_columns:], attention_mask_BL[:, num_prompt_columns:])


# ---------------------------------------------------------------- how a chunk of groups is laid out

def prompt_shared_tokens(chunk: Groups) -> int:
    """Tokens the prompt-shared forward runs: each prompt once, then every completion."""
    return sum(chunk.prompt_lengths) + sum(chunk.lengths)


def row_tokens(chunk: Groups) -> int:
    """Tokens TRL's own forward runs for the chunk's rows (real tokens only): each row its prompt and completion."""
    return sum(p * size for p, size in zip(chunk.prompt_lengths, chunk.sizes)) + sum(chunk.lengths)


# ``sharing`` -> whether a chunk runs as one trie, given the chunk and a thunk building its trie (built only
# when asked: the trie reads every id on the host).
SHARING = {
    "prompt": lambda chunk, trie: False,
    "tree": lambda chunk, trie: True,
    # the trie when it runs fewer tokens than prompt sharing: some completions of a group begin alike, or
    # the prompts of different groups do (a common system turn)
    "auto": lambda chunk, trie: trie().num_tokens < prompt_shared_tokens(chunk),
}


def check_sharing(sharing: str) -> str:
    """``sharing`` itself, or ValueError naming the allowed values."""
    if not isinstance(sharing, str) or sharing not in SHARING:  # (a list is unhashable: check the type first)
        raise ValueError(f"sharing must be one of {sorted(SHARING)} (a string), got {sharing!r}")
    return sharing


def chunk_logprobs(model, chunk: Groups, sharing: str, temperature: float,
                   with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None, int, bool]:
    """Log-probs ``[Nq]`` and entropies ``[Nq]`` (or None) of every completion token of ``chunk``, in Groups
    order, the tokens the forward ran, and whether it ran as a trie.

    The trie's sequences are the chunk's rows in Groups order, each scoring its completion tokens
    (``trie_of_groups``), so :func:`tree_logprobs` returns them in the same order as ``compute_logprobs``.
    """
    trie = functools.cache(lambda: trie_of_groups(chunk.prompts, chunk.nested()))
    if SHARING[sharing](chunk, trie):
        result = tree_logprobs(model, trie(), temperature=temperature, with_entropy=with_entropy)
        return result.logps, result.entropy, trie().num_tokens, True
    result = compute_logprobs(model, chunk.prompts, chunk.nested(), temperature=temperature,
                              with_entropy=with_entropy)
    return result.logps, result.entropy, prompt_shared_tokens(chunk), False


class SharedPrefixMixin:
    """Replaces GRPOTrainer's per-token log-probs with the shared-prefix forward (see the module doc)."""

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **extra_inputs):
        """Per-token log-probs ``[B, C]`` (0 at padding), entropies ``[B, C]`` or None, aux loss (None).

        ``input_ids``/``attention_mask`` are ``[B, L]``: prompts then completions, the last
        ``logits_to_keep`` = C columns being the completions, exactly as TRL passes them.
        """
        try:
            groups, rows = shareable_groups(self, model, input_ids, attention_mask, logits_to_keep,
                                      compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss,
                                      extra_inputs=extra_inputs)
        except NotShareable as err:
            self._note_fallback(str(err))
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **extra_inputs)
        self._note_shared(groups)
        logps, entropies, indices = [], [], []
        for chunk, chunk_rows in split_groups(groups, rows, batch_size):
            with self.accelerator.autocast():
                chunk_logps, chunk_entropy, num_tokens, as_tree = chunk_logprobs(
                    model, chunk, self.shared_prefix_sharing, self.temperature, compute_entropy)
            self._note_layout(chunk, num_tokens, as_tree)
            logps.append(chunk_logps)
            entropies.append(chunk_entropy)
            indices.append(scatter_index(chunk, chunk_rows, logits_to_keep))
        index = torch.cat(indices).to(input_ids.device)
        num_cells = input_ids.shape[0] * logits_to_keep

        def to_rows(flat: list[torch.Tensor]) -> torch.Tensor:
            values = torch.cat(flat)
            return values.new_zeros(num_cells).index_copy(0, index, values).view(-1, logits_to_keep)

        return to_rows(logps), to_rows(entropies) if compute_entropy else None, None

    def _note_fallback(self, reason: str) -> None:
        stats = self.shared_prefix_stats
        stats.num_fallback_calls += 1
        if reason not in stats.fallback_reasons:
            logger.warning("turbogrpo: this log-prob call runs TRL's own forward (no prompt sharing) because %s. "
                           "Logged once per reason; see trainer.shared_prefix_stats.", reason)
        stats.fallback_reasons[reason] = stats.fallback_reasons.get(reason, 0) + 1

    def _note_layout(self, chunk: Groups, num_tokens: int, as_tree: bool) -> None:
        stats = self.shared_prefix_stats
        stats.num_tree_calls += as_tree
        stats.num_tokens_run += num_tokens
        stats.num_row_tokens += row_tokens(chunk)

    def _note_shared(self, groups: Groups) -> None:
        stats = self.shared_prefix_stats
        partial = sum(size < self.num_generations for size in groups.sizes)
        if partial and not stats.num_partial_groups:
            logger.info("turbogrpo: a batch holds only part of some groups (TRL shuffles a generation batch "
                        "before cutting it into micro-batches); the members present share their prompt.")
        stats.num_shared_calls += 1
        stats.num_rows += groups.num_completions
        stats.num_prompt_forwards += groups.num_groups
        stats.num_partial_groups += partial


class SharedPrefixGRPOTrainer(SharedPrefixMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` whose per-token log-probs run each distinct prompt once (same arguments).

    ``sharing``: ``"auto"`` (default) runs a call's rows as one trie when that runs fewer tokens than
    sharing the prompts (multi-turn rows with the same first turn, prompts with a common system turn), else
    shares the prompts; ``"tree"`` always runs the trie; ``"prompt"`` shares the prompts only.
    """

    def __init__(self, *args, sharing: str = "auto", **kwargs):
        check_trl_version()
        self.shared_prefix_sharing = check_sharing(sharing)
        self.shared_prefix_stats = SharedPrefixStats()
        super().__init__(*args, **kwargs)
        check_models(self)


def enable_shared_prefix(trainer: GRPOTrainer, sharing: str = "auto") -> GRPOTrainer:
    """Give an existing ``GRPOTrainer`` (or subclass) instance the shared-prefix forward; returns it.

    The instance's class becomes a subclass of its own class with :class:`SharedPrefixMixin` first,
    so the instance keeps every override it had and still passes ``isinstance`` checks. ``sharing`` as
    :class:`SharedPrefixGRPOTrainer`'s.
    """
    check_trl_version()
    if not isinstance(trainer, GRPOTrainer):
        raise ValueError(f"enable_shared_prefix takes a trl.GRPOTrainer, got {type(trainer).__name__}")
    trainer.shared_prefix_sharing = check_sharing(sharing)
    check_models(trainer)
    if not isinstance(trainer, SharedPrefixMixin):
        trainer.__class__ = _shared_prefix_class(type(trainer))
        trainer.shared_prefix_stats = SharedPrefixStats()
    return trainer


def check_models(trainer: GRPOTrainer) -> None:
    """ValueError when the policy or reference model transforms its logits in a way turbogrpo does not know
    (``turbogrpo.output_head.check_logits_head``; TRL's fused head would score it wrongly too). Multimodal models
    always run TRL's own code, so they are not probed."""
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is None:
            continue
        base = trainer.accelerator.unwrap_model(model)
        base = base.get_base_model() if hasattr(base, "get_base_model") else base
        if base.config.get_text_config() is base.config:
            check_logits_head(base)


@functools.cache
def _shared_prefix_class(trainer_class: type) -> type:
    """One shared-prefix subclass per trainer class (so repeated calls do not pile up classes)."""
    return type(f"SharedPrefix{trainer_class.__name__}", (SharedPrefixMixin, trainer_class), {})


# ---- a TRL user's off-policy correction, as turbogrpo's [algo] settings ---------------------------------

# TRL's vllm_importance_sampling_mode values: turbogrpo's registry (turbogrpo.algo.OFF_POLICY_CORRECTIONS) has
# each under the same name, with the same formula (tests/algo/test_corrections.py checks it against TRL's).
TRL_IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def off_policy_correction_of(args) -> dict[str, object]:
    """The ``algo.*`` settings that correct rollouts as the ``GRPOConfig`` ``args`` does in TRL:
    ``off_policy_correction`` (``vllm_importance_sampling_mode``, same name), ``tis_cap``
    (``vllm_importance_sampling_clip_max``, which the deprecated ``vllm_importance_sampling_cap`` sets; None,
    no upper bound, is infinity) and ``tis_cap_low`` (``vllm_importance_sampling_clip_min``; None is 0). TRL
    corrects only vLLM rollouts: without ``use_vllm`` or with ``vllm_importance_sampling_correction`` off the
    correction is off (``tis_cap`` 0). ValueError for what has no equal here: another mode, and
    ``off_policy_mask_threshold`` (DeepSeek-V3.2's advantage-dependent sequence mask)."""
    if getattr(args, "off_policy_mask_threshold", None) is not None:
        raise ValueError(f"off_policy_mask_threshold={args.off_policy_mask_threshold} (DeepSeek-V3.2's "
                         "off-policy sequence mask) has no turbogrpo setting yet; unset it, or keep TRL's trainer")
    if not (args.use_vllm and args.vllm_importance_sampling_correction):
        return {"off_policy_correction": "tis", "tis_cap": 0.0, "tis_cap_low": 0.0}
    mode = args.vllm_importance_sampling_mode
    if mode not in TRL_IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"vllm_importance_sampling_mode={mode!r} is not one of TRL's "
                         f"{', '.join(TRL_IMPORTANCE_SAMPLING_MODES)}")
    high, low = args.vllm_importance_sampling_clip_max, args.vllm_importance_sampling_clip_min
    return {"off_policy_correction": mode, "tis_cap": float("inf") if high is None else float(high),
            "tis_cap_low": 0.0 if low is None else float(low)}
