"""Accelerate's FSDP2 path (``accelerate launch`` with ``fsdp_version: 2``, ``Trainer`` with an FSDP2 ``fsdp_config``)
keeps the mHC hyper-connection modules float32.

Accelerate shards a model in ``fsdp2_prepare_model`` with ONE ``MixedPrecisionPolicy`` for every unit; with
``mixed_precision: bf16`` it is ``param_dtype = reduce_dtype = output_dtype = bfloat16``. On the hyper-connection (HC)
modules (``attn_hc``, ``ffn_hc``: :class:`~hf_mhc.MHCHyperConnection`; ``hc_head``: :class:`~hf_mhc.MHCHyperHead`)
that policy all-gathers ``fn``, ``base``, ``scale`` (``hc_fn``, ``hc_base``, ``hc_scale``) in bf16, so the ``pre``,
``post`` and Sinkhorn ``comb`` maps come from bf16-rounded weights, and it reduces their gradients in bf16. Listing
the HC classes in ``_no_split_modules`` gives them units of their own, but under that same policy. Neither Accelerate
(up to 1.15) nor FSDP2 has a per-module policy hook, so importing ``hf_mhc`` calls :func:`install`, which wraps the
one function Accelerate calls to shard (``accelerate.accelerator.fsdp2_prepare_model``): for a model holding HC
modules, :func:`shard_hyper_connections` first makes each of them an FSDP2 unit with :func:`hc_mixed_precision`, on
Accelerate's mesh with its resharding, offload and ignored-module settings; Accelerate's own function then shards the
rest with the user's policy and skips modules that already are FSDP units. Any other model goes through unchanged.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from .modeling_mhc import MHCHyperConnection, MHCHyperHead

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch.distributed.fsdp import MixedPrecisionPolicy

logger = logging.getLogger(__name__)

__all__ = ["hc_mixed_precision", "install", "shard_hyper_connections"]

_MARK = "_hf_mhc_keeps_hc_float32"  # set on the wrapper: install() is idempotent


def hc_mixed_precision() -> MixedPrecisionPolicy:
    """The FSDP2 policy of the HC units: gather and compute in the parameters' own dtype (float32), reduce gradients
    in float32, leave the streams they receive and the maps they return uncast."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32, output_dtype=None,
                                cast_forward_inputs=False)


def _hc_modules(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if isinstance(module, (MHCHyperConnection, MHCHyperHead))]


def shard_hyper_connections(accelerator: Accelerator, model: nn.Module) -> int:
    """Make every HC module of ``model`` an FSDP2 unit with :func:`hc_mixed_precision`, as Accelerate would shard it
    otherwise (its mesh, ``reshard_after_forward``, ``cpu_offload`` and ``ignored_modules``). HC parameters that are not
    float32 (a model cast with ``model.to(torch.bfloat16)``) are upcast first: mHC keeps them float32 in any model
    dtype. Returns the number of HC modules sharded."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    modules = [module for module in _hc_modules(model) if not isinstance(module, FSDPModule)]
    if not modules:
        return 0
    plugin = accelerator.state.fsdp_plugin
    if plugin.cpu_ram_efficient_loading:
        raise ValueError(
            "mHC models under Accelerate FSDP2 need fsdp_cpu_ram_efficient_loading: false (their float32 HC units are "
            "sharded before Accelerate's meta-device reload); or shard with hf_mhc.distributed.apply_fsdp2."
        )
    upcast = []
    for module in modules:
        for name, parameter in module.named_parameters():
            if parameter.dtype != torch.float32:
                parameter.data = parameter.data.float()
                upcast.append(name)
    if upcast:
        logger.info("Upcast %d HC parameters to float32 before sharding: %s", len(upcast), sorted(set(upcast)))
    mesh = accelerator.torch_device_mesh
    kwargs = {
        "mesh": mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None,
        "reshard_after_forward": plugin.reshard_after_forward,
        "offload_policy": plugin.cpu_offload,
        "mp_policy": hc_mixed_precision(),
    }
    if plugin.ignored_modules is not None:
        from accelerate.utils.fsdp_utils import get_parameters_from_modules

        kwargs["ignored_params"] = get_parameters_from_modules(plugin.ignored_modules, model, accelerator.device)
    for module in modules:
        fully_shard(module, **kwargs)
    return len(modules)


def install() -> None:
    """Wrap ``accelerate.accelerator.fsdp2_prepare_model`` so that mHC models keep float32 HC units (see the module
    docstring). Called by ``import hf_mhc``; calling it again changes nothing."""
    import accelerate.accelerator

    prepare = getattr(accelerate.accelerator, "fsdp2_prepare_model", None)
    if prepare is None:
        logger.warning("This Accelerate has no fsdp2_prepare_model: under its FSDP2 the mHC maps follow its policy.")
        return
    if getattr(prepare, _MARK, False):
        return

    @functools.wraps(prepare)
    def fsdp2_prepare_model(accelerator, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(getattr(model, "_orig_mod", model), FSDPModule):  # Accelerate leaves a sharded model be
            shard_hyper_connections(accelerator, model)
        return prepare(accelerator, model)

    setattr(fsdp2_prepare_model, _MARK, True)
    accelerate.accelerator.fsdp2_prepare_model = fsdp2_prepare_model
