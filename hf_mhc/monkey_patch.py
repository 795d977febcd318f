"""``apply_mhc_kernels``: monkey patches that run the hyper-connections of transformers' own models (DeepSeek-V4,
GLM-5-Next, HY-V4, HY-V4-VL) through the ops of ``hf_mhc.kernels`` (looked up in their dispatch table per call)."""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType

import torch
from torch import nn
from transformers.utils.deprecation import deprecate_kwarg

from .compat import unweighted_norm_eps
from .kernels.dispatch import mhc_ops
from .kernels.functional import backend_implementation, mhc_coeffs_pre, mhc_head, mhc_post_res


def _hyper_connection_forward(backend: str | None):
    def forward(self, hidden_streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[B, S, n, D]`` -> ``post [B, S, n]``, ``comb [B, S, n, n]``, ``collapsed [B, S, D]``, as upstream."""
        collapsed, post, comb = mhc_coeffs_pre(
            hidden_streams, self.fn, self.base, self.scale, sinkhorn_iters=self.hc_sinkhorn_iters, eps=self.hc_eps,
            norm_eps=unweighted_norm_eps(self.input_norm), backend=backend,
        )
        return post, comb, collapsed

    return forward


def _hyper_head_forward(backend: str | None):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mhc_head(x, self.hc_fn, self.hc_base, self.hc_scale, eps=self.eps,
                        norm_eps=unweighted_norm_eps(self.input_norm), backend=backend)

    return forward


def _deepseek_v4_decoder_forward(backend: str | None):
    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """DeepSeek-V4's decoder layer with both stream merges fused (``mhc_post_res``)."""
        post, comb, collapsed = self.attn_hc(hidden_states)
        attn_output, _ = self.self_attn(self.input_layernorm(collapsed), **kwargs)
        hidden_states = mhc_post_res(hidden_states, attn_output, post, comb, backend=backend)
        post, comb, collapsed = self.ffn_hc(hidden_states)
        mlp_output = self.mlp(self.post_attention_layernorm(collapsed), input_ids=input_ids)
        return mhc_post_res(hidden_states, mlp_output, post, comb, backend=backend)

    return forward


def _enter(hyper_connection: nn.Module,
           streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(post, comb, collapsed)`` of a patched hyper-connection; ``comb`` is ``None`` for HY-V4's identity map, whose
    hyper-connection returns ``(post, collapsed)``."""
    maps = hyper_connection(streams)
    return maps if len(maps) == 3 else (maps[0], None, maps[1])


def _indexed_attention_decoder_forward(backend: str | None):
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        prev_topk_indices: torch.LongTensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.LongTensor | None]:
        """The decoder layer of GLM-5-Next (linear or indexed attention) and of HY-V4 / HY-V4-VL (indexed attention,
        the identity map) with both stream merges fused (``mhc_post_res``; ``comb=None`` for the identity map);
        returns ``(streams, topk_indices)`` as upstream."""
        post, comb, collapsed = _enter(self.attn_hc, hidden_states)
        attn_input = self.input_layernorm(collapsed)
        topk_indices = None
        if getattr(self, "block_type", None) == "linear_attention":
            attn_output = self.self_attn(hidden_states=attn_input, cache=cache, attention_mask=attention_mask, **kwargs)
        else:
            attn_output, _, topk_indices = self.self_attn(
                hidden_states=attn_input, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                use_cache=use_cache, position_embeddings=position_embeddings, prev_topk_indices=prev_topk_indices,
                **kwargs,
            )
        hidden_states = mhc_post_res(hidden_states, attn_output, post, comb, backend=backend)
        post, comb, collapsed = _enter(self.ffn_hc, hidden_states)
        mlp_output = self.mlp(self.post_attention_layernorm(collapsed))
        return mhc_post_res(hidden_states, mlp_output, post, comb, backend=backend), topk_indices

    return forward


def _identity_hyper_connection_forward(backend: str | None):
    def forward(self, hidden_streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """HY-V4's hyper-connection, the identity map: ``[B, S, n, D]`` -> ``post [B, S, n]``
        (``hc_magnitude·σ(...) + hc_eps``) and ``collapsed [B, S, D]``, as upstream."""
        collapsed, post, _ = mhc_coeffs_pre(
            hidden_streams, self.fn, self.base, self.scale, sinkhorn_iters=1, eps=self.hc_eps,
            norm_eps=unweighted_norm_eps(self.input_norm), backend=backend, residual_map="identity",
            post_magnitude=self.hc_post_magnitude,
        )
        return post, collapsed

    return forward


def patched_modules(backend: str | None) -> dict[type[nn.Module], Callable]:
    """The transformers modules ``apply_mhc_kernels`` patches, each with its new forward (the one list of what it
    supports)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4
    from transformers.models.glm5_next import modeling_glm5_next as glm5
    from transformers.models.hy_v4 import modeling_hy_v4 as hyv4
    from transformers.models.hy_v4_vl import modeling_hy_v4_vl as hyv4_vl

    return {
        dsv4.DeepseekV4HyperConnection: _hyper_connection_forward(backend),
        dsv4.DeepseekV4HyperHead: _hyper_head_forward(backend),
        dsv4.DeepseekV4DecoderLayer: _deepseek_v4_decoder_forward(backend),
        glm5.Glm5NextTextHyperConnection: _hyper_connection_forward(backend),
        glm5.Glm5NextTextDecoderLayer: _indexed_attention_decoder_forward(backend),
        hyv4.HYV4HyperConnection: _identity_hyper_connection_forward(backend),
        hyv4.HYV4HyperHead: _hyper_head_forward(backend),
        hyv4.HYV4DecoderLayer: _indexed_attention_decoder_forward(backend),
        hyv4_vl.HYV4VLHyperConnection: _identity_hyper_connection_forward(backend),
        hyv4_vl.HYV4VLHyperHead: _hyper_head_forward(backend),
        hyv4_vl.HYV4VLDecoderLayer: _indexed_attention_decoder_forward(backend),
    }


def apply_mhc_kernels(model: nn.Module, backend: str | None = None) -> nn.Module:
    """Patch, in place, a transformers model carrying DeepSeek-V4's hyper-connection design so that its mHC math
    runs through ``hf_mhc.kernels`` (fused Triton kernels on CUDA, memory-light torch kernels elsewhere).

    DeepSeek-V4: ``DeepseekV4HyperConnection``, ``DeepseekV4HyperHead`` and the stream merges of
    ``DeepseekV4DecoderLayer``. GLM-5-Next: ``Glm5NextTextHyperConnection`` and the stream merges of
    ``Glm5NextTextDecoderLayer`` (its head is a plain mean, left as it is). HY-V4 (``HYV4ForCausalLM``) and the text
    model of HY-V4-VL (``HYV4VLTextModel``, also inside ``HYV4VLForConditionalGeneration``): ``HYV4HyperConnection``
    (the identity map, ``residual_map="identity"`` with ``post_magnitude = hc_magnitude``), ``HYV4HyperHead`` and the
    identity merges of ``HYV4DecoderLayer``, and their ``HYV4VL`` twins. In float32 the numbers are upstream's up to
    rounding; so they are for HY-V4 in bf16 / fp16, whose merges also compute in float32 and round once. DeepSeek-V4
    and GLM-5-Next first round ``post`` and ``comb`` to the stream dtype, where our merges keep them float32. Returns
    ``model``.
    """
    if backend is not None:
        mhc_ops(backend_implementation(backend), next(model.parameters()))  # ValueError where it cannot run
    patches = patched_modules(backend)
    patched = 0
    for module in model.modules():
        forward = patches.get(type(module))
        if forward is not None:
            module.forward = MethodType(forward, module)
            patched += 1
    if patched == 0:
        supported = ", ".join(cls.__name__ for cls in patches)
        raise ValueError(f"apply_mhc_kernels found no hyper-connection module in {type(model).__name__}; "
                         f"it patches {supported}.")
    return model
