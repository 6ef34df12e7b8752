"""LFM2's gated short convolution: ``out_proj(C * conv(B * x))``, the convolution causal along each token's path.

Its only state is the convolution's last ``L_cache - 1`` inputs, which ``forest.path_conv`` reads from the
parent segment's last tokens (one gather for the whole forest, no level loop) and the rollout engine keeps per row.

Shape legend: N flat tokens, Hd hidden size.
"""

from __future__ import annotations

from turbogrpo.mixers.registry import MixerUnit, depthwise_conv, register_mixer


@register_mixer("Lfm2ShortConv", "Lfm2MoeShortConv")
class ShortConv(MixerUnit):
    what = "gated short convolution"

    def forward(self, module, hidden, layout):
        b, c, x = module.in_proj(hidden.flatten(0, -2)).chunk(3, dim=-1)   # [N, Hd] each
        conv = layout.conv(module, b * x, *depthwise_conv(module.conv))
        return module.out_proj(c * conv).view_as(hidden)

    def padding_reaches_state(self, module):
        return module.in_proj.bias is not None   # a pad's B * x is bias * bias, in the next tokens' window
