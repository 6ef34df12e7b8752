"""Mamba-2 (Nemotron-H, Granite 4.0-H, Bamba, Zamba2, Falcon-H1): a causal convolution, then the selective scan.

Over the training forwards' forest, the convolution runs along each token's path (``forest.path_conv``), the scan
level by level with transformers' chunked kernel (``mamba2_chunk_scan``, or mamba-ssm's where installed), each level
from its parents' final ``[H, P, Ns]`` states; the rollout engine decodes with the recurrence itself
(:func:`recurrent_scan_rows`), from each row's stored state. The unit discretises ``dt`` itself (bias, softplus,
clamp to the module's limits: the same operations the kernel applies) and hands the kernel the result with a limit
of ``[0, inf)``, so that a right-padded row's pad slots can get ``dt = 0``: no decay, no write, and the row ends in
the state of its last real token.

Shape legend: N flat tokens, I the inner size (H heads of P), G groups of Ns state channels, C = I + 2 G Ns the
convolution's channels.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from turbogrpo.mixers.registry import MixerUnit, at_least_float32, depthwise_conv, modeling_function, register_mixer

CHUNK_KERNEL = "mamba2_chunk_scan"   # the name of the chunked scan in the modeling files


@register_mixer("NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer", "BambaMixer", "Zamba2MambaMixer")
class Mamba2(MixerUnit):
    what = "Mamba-2 selective state space"

    def forward(self, module, hidden, layout):
        x_NH = hidden.flatten(0, -2)
        gate, xbc_NC, dt = self.project(module, x_NH).split(
            [module.intermediate_size, module.conv_dim, module.num_heads], dim=-1)
        xbc_NC = ACT2FN[module.activation](layout.conv(module, xbc_NC, *depthwise_conv(module.conv1d)))
        group_size = module.n_groups * module.ssm_state_size
        x, b, c = xbc_NC.split([module.intermediate_size, group_size, group_size], dim=-1)
        # As the kernel discretises it, from the projection's dt and the module's bias and limits.
        dt = F.softplus(dt + module.dt_bias.to(dt.dtype)).clamp(*module.time_step_limit)
        a = -torch.exp(at_least_float32(module.A_log))   # as the module's .float(), but float64 stays float64
        b, c = (t.unflatten(-1, (module.n_groups, -1)) for t in (b, c))
        y_NHP = layout.scan(module, (x.unflatten(-1, (module.num_heads, module.head_dim)), dt, b, c),
                            chunked=partial(scan_rows, modeling_function(module, CHUNK_KERNEL), a, module),
                            recurrent=partial(recurrent_scan_rows, a, module))
        out = module.out_proj(self.gate_output(module, y_NHP.flatten(1), gate).to(x_NH.dtype))
        return out.view(*hidden.shape[:-1], -1)

    def padding_reaches_state(self, module):
        return module.in_proj.bias is not None   # into the next tokens' convolution window

    @staticmethod
    def project(module, x_NH):
        """``[N, I + C + H]``: the gate, the convolution's input and dt, from the module's input projection."""
        return module.in_proj(x_NH)

    @staticmethod
    def gate_output(module, y, gate):
        """``[N, I]``: the scan's output gated (and normed) as the module does it."""
        return module.norm(y, gate)


@register_mixer("FalconH1Mixer")
class FalconH1Mamba2(Mamba2):
    """Falcon-H1: its input and projection multipliers (muP), and the gate applied by a norm or a plain SiLU."""

    @staticmethod
    def project(module, x_NH):
        projected = module.in_proj(x_NH * module.ssm_in_multiplier)
        return projected * module.mup_vector.reshape(-1)   # the muP vector is stored [1, 1, I + C + H]

    @staticmethod
    def gate_output(module, y, gate):
        return module.norm(y, gate) if module.mamba_rms_norm else y * F.silu(gate)


def scan_rows(kernel, a, module, x, dt, b, c, *, valid, initial_state):
    """One level's padded rows through the chunked scan: ``x [R, W, H, P]``, ``dt [R, W, H]`` (discretised),
    ``b, c [R, W, G, Ns]``, ``valid [R, W]``; ``initial_state`` ``([R, H, P, Ns],)`` or None (zero).
    Returns ``(y [R, W, H, P], (final state [R, H, P, Ns],))``."""
    dt = dt.masked_fill(~valid[..., None], 0.0)   # a pad slot neither decays nor writes the state
    y, final = kernel(x, dt, a, b, c, chunk_size=module.chunk_size, D=module.D, dt_bias=None, dt_softplus=False,
                      dt_limit=(0.0, float("inf")), initial_states=None if initial_state is None else initial_state[0],
                      return_final_states=True)
    return y, (final,)


def recurrent_scan_rows(a, module, x, dt, b, c, *, valid, initial_state):
    """:func:`scan_rows` token by token (the rollout's decoding form): ``state = exp(dt a) state + dt x b^T``,
    ``y = state c + D x``, in float32 at least as the chunked kernel computes. Same arguments and returns."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    num_heads = x.shape[2]
    dt = dt.masked_fill(~valid[..., None], 0.0).to(dtype)   # a pad slot neither decays nor writes the state
    x, b, c = (t.to(dtype) for t in (x, b, c))
    b, c = (t.repeat_interleave(num_heads // t.shape[2], dim=2) for t in (b, c))   # [R, W, H, Ns]
    state = (x.new_zeros(x.shape[0], num_heads, x.shape[3], b.shape[3]) if initial_state is None
             else initial_state[0].to(dtype))
    decay = torch.exp(dt * a.to(dtype))   # [R, W, H]
    skip_H1 = module.D.to(dtype)[:, None]
    outputs = []
    for t in range(x.shape[1]):
        written = (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]   # [R, H, P, Ns]
        state = state * decay[:, t, :, None, None] + written
        outputs.append((state @ c[:, t, :, :, None])[..., 0] + skip_H1 * x[:, t])
    return torch.stack(outputs, 1), (state,)
