"""Gated DeltaNet (Qwen3.5, Qwen3-Next, OLMo-hybrid, Kimi Linear): a causal convolution, then the delta rule.

Both run over the layout (``registry.TokenLayout``). Over the training forwards' forest: the convolution along
each token's path (``forest.path_conv``: a child's first tokens read its parent's last inputs, the convolution's
state), the delta rule level by level with transformers' chunked kernel (``torch_chunk_gated_delta_rule``, or
flash-linear-attention's where installed), each level from its parents' final ``[Hv, Dk, Dv]`` states. In the
rollout engine, from each row's stored states, with the token-by-token kernel
(``torch_recurrent_gated_delta_rule``) when it decodes. A right-padded row's pad slots get ``g = 0`` (no decay) and
``beta = 0`` (no write), so its final state is the state at its last real token, exactly.

Shape legend: N flat tokens, C the convolution's channels (2 Hk Dk + Hv Dv), Hk / Hv key / value heads,
Dk / Dv their sizes, R rows and W width of one level's padded call.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from turbogrpo.mixers.registry import MixerUnit, at_least_float32, depthwise_conv, modeling_function, register_mixer

@register_mixer("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")
class GatedDeltaNet(MixerUnit):
    """Qwen3.5's module; the families differ in the hooks below (their projections, gates and output)."""

    what = "gated DeltaNet (linear attention)"
    kernel = "torch_chunk_gated_delta_rule"                 # the chunked kernel's name in the modeling file
    recurrent_kernel = "torch_recurrent_gated_delta_rule"   # its token-by-token form (same arguments)

    def forward(self, module, hidden, layout):
        x_NH = hidden.flatten(0, -2)
        mixed_qkv_NC, z, b, a = self.project(module, x_NH)
        mixed_qkv_NC = ACT2FN[module.activation](layout.conv(module, mixed_qkv_NC, *depthwise_conv(module.conv1d)))
        query, key, value = self.heads(module, mixed_qkv_NC)
        g, beta = self.decay_and_beta(module, x_NH, b, a)
        core = layout.scan(module, (query, key, value, g, beta),
                           chunked=partial(delta_rule_rows, modeling_function(module, self.kernel)),
                           recurrent=partial(delta_rule_rows, modeling_function(module, self.recurrent_kernel)))
        return self.output(module, core, z).view(*hidden.shape[:-1], -1)

    def project(self, module, x_NH):
        """``(mixed_qkv [N, C], z [N, Hv, Dv], b, a)`` from the module's input projections: the convolution's
        input, the output gate, and what :meth:`decay_and_beta` takes."""
        z = module.in_proj_z(x_NH).unflatten(-1, (-1, module.head_v_dim))
        return module.in_proj_qkv(x_NH), z, module.in_proj_b(x_NH), module.in_proj_a(x_NH)

    def heads(self, module, mixed_qkv_NC):
        """``query, key [N, Hv, Dk]``, ``value [N, Hv, Dv]`` from the convolution's output (key heads repeated
        for each of their value heads)."""
        query, key, value = mixed_qkv_NC.split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
        query, key = (t.unflatten(-1, (-1, module.head_k_dim)) for t in (query, key))
        repeat = module.num_v_heads // module.num_k_heads
        if repeat > 1:
            query, key = (t.repeat_interleave(repeat, dim=1) for t in (query, key))
        return query, key, value.unflatten(-1, (-1, module.head_v_dim))

    def decay_and_beta(self, module, x_NH, b, a):
        """``g [N, Hv]`` (log decay) and ``beta [N, Hv]`` (write strength)."""
        # In float32 at least, as the module (a half-precision A would overflow to -inf); unlike its .float(), a
        # float64 model keeps float64 (the module rounds A and a to float32 there).
        g = -at_least_float32(module.A_log).exp() * F.softplus(at_least_float32(a) + module.dt_bias)
        return g, b.sigmoid()

    def output(self, module, core_NVD, z):
        """``[N, Hd]``: the rule's output ``[N, Hv, Dv]`` normed, gated by ``z`` and projected out."""
        core = module.norm(core_NVD.flatten(0, 1), z.flatten(0, 1))
        return module.out_proj(core.unflatten(0, core_NVD.shape[:2]).flatten(1))


@register_mixer("Qwen3NextGatedDeltaNet")
class FusedProjectionGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next: q, k, v, z and b, a come out of two fused projections, grouped by key head."""

    def project(self, module, x_NH):
        query, key, value, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(x_NH)[None],
                                                                         module.in_proj_ba(x_NH)[None])
        mixed_qkv = torch.cat([t[0].flatten(1) for t in (query, key, value)], dim=-1)
        return mixed_qkv, z[0], b[0], a[0]


@register_mixer("OlmoHybridGatedDeltaNet")
class SeparateProjectionGatedDeltaNet(GatedDeltaNet):
    """OLMo-hybrid: q, k, v, the gate, a and b from separate projections; beta in [0, 2] where the config allows
    negative eigenvalues; its own output norm and projection."""

    def project(self, module, x_NH):
        mixed_qkv = torch.cat([module.q_proj(x_NH), module.k_proj(x_NH), module.v_proj(x_NH)], dim=-1)
        z = module.g_proj(x_NH).unflatten(-1, (-1, module.head_v_dim))
        return mixed_qkv, z, module.b_proj(x_NH), module.a_proj(x_NH)

    def decay_and_beta(self, module, x_NH, b, a):
        g, beta = super().decay_and_beta(module, x_NH, b, a)
        return g, beta * (2.0 if module.allow_neg_eigval else 1.0)

    def output(self, module, core_NVD, z):
        core = module.o_norm(core_NVD.flatten(0, 1), z.flatten(0, 1))
        return module.o_proj(core.unflatten(0, core_NVD.shape[:2]).flatten(1))


@register_mixer("KimiLinearDeltaAttention")
class KimiDeltaAttention(SeparateProjectionGatedDeltaNet):
    """Kimi Linear: a decay per key channel (``g [N, H, Dk]``, from its forget gate) and its own kernel; as many
    key as value heads; a low-rank output gate."""

    what = "Kimi delta attention (linear attention)"
    kernel = "chunk_kimi_delta_attention"
    recurrent_kernel = "recurrent_kimi_delta_attention"

    def project(self, module, x_NH):
        mixed_qkv = torch.cat([module.q_proj(x_NH), module.k_proj(x_NH), module.v_proj(x_NH)], dim=-1)
        z = module.g_b_proj(module.g_a_proj(x_NH)).unflatten(-1, (-1, module.head_dim))
        return mixed_qkv, z, module.b_proj(x_NH), None

    def heads(self, module, mixed_qkv_NC):
        return tuple(t.unflatten(-1, (-1, module.head_dim)) for t in mixed_qkv_NC.chunk(3, dim=-1))

    def decay_and_beta(self, module, x_NH, b, a):
        return module.forget_gate(x_NH[None])[0], b.sigmoid()   # the gate reads [B, T, Hd]


def delta_rule_rows(kernel, query, key, value, g, beta, *, valid, initial_state):
    """Padded rows (one level's, or the rollout's new tokens) through ``kernel`` (chunked or recurrent):
    ``query, key [R, W, Hv, Dk]``, ``value [R, W, Hv, Dv]``, ``g [R, W, Hv]`` (or ``[R, W, Hv, Dk]``: a decay per
    key channel), ``beta [R, W, Hv]``, ``valid [R, W]``;
    ``initial_state`` ``([R, Hv, Dk, Dv],)`` or None (zero). Returns ``(out [R, W, Hv, Dv], (final state,))``."""
    pad = ~valid[..., None]
    # A pad slot neither decays nor writes the state, so each row ends in the state of its last real token.
    g, beta = g.masked_fill(pad.view(*pad.shape, *(1,) * (g.dim() - 3)), 0.0), beta.masked_fill(pad, 0.0)
    out, final = kernel(query, key, value, g=g, beta=beta, initial_state=None if initial_state is None
                        else initial_state[0], output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out, (final,)
