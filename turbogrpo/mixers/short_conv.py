"""LFM2's gated short convolution: ``out_proj(C * conv(B * x))``, the convolution causal along each token's path.

Its only state is the convolution's last ``L_cache - 1`` inputs, which ``forest.path_conv`` reads from the
parent segment's last tokens: one gather for the whole forest, no level loop.

Shape legend: N flat tokens, Hd hidden size.
"""

from __future__ import annotations

from turbogrpo.mixers.forest import path_conv
from turbogrpo.mixers.registry import MixerUnit, register_mixer


@register_mixer("Lfm2ShortConv", "Lfm2MoeShortConv")
class ShortConv(MixerUnit):
    what = "gated short convolution"

    def forward(self, module, hidden_1NH, forest):
        b, c, x = module.in_proj(hidden_1NH[0]).chunk(3, dim=-1)   # [N, Hd] each
        conv = path_conv(b * x, forest.taps(module.conv_kernel_size), module.conv.weight[:, 0], module.conv.bias)
        return module.out_proj(c * conv)[None]

    def padding_reaches_state(self, module):
        return module.in_proj.bias is not None   # a pad's B * x is bias * bias, in the next tokens' window
