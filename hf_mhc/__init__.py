"""hf-mhc: Manifold-Constrained Hyper-Connections (mHC) for Hugging Face Transformers.

Importing this package registers ``MHCConfig`` (``model_type="mhc"``) and the mHC models with
``AutoConfig``, ``AutoModel``, ``AutoModelForCausalLM`` and ``AutoModelForSequenceClassification``. It also changes
two things outside the package, each because no later point is sure to come first:

- it sets ``MHCForCausalLM`` on the ``transformers`` module (:mod:`hf_mhc.serving`): transformers' ``serve`` (5.25)
  spawns a model process that imports the ``hf-mhc`` script's package and looks the checkpoint's class up on the
  ``transformers`` module there, with no call of ours in between;
- it wraps two functions of Accelerate so that its FSDP2 (``accelerate launch``, ``Trainer``) keeps the
  hyper-connection modules float32 (:mod:`hf_mhc.accelerate_fsdp2`): a training script calls Accelerate, never
  hf-mhc, between loading the model and sharding it. Both wrappers change nothing for a model without HC modules,
  and installing them again changes nothing.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)

from . import modeling_mhc
from .accelerate_fsdp2 import install as _install_accelerate_fsdp2
from .compat import warn_if_untested
from .configuration_mhc import SUPPORTED_BACKBONES, MHCConfig
from .modeling_mhc import *  # noqa: F403  (the mHC model classes: modeling_mhc.__all__)

AutoConfig.register(MHCConfig.model_type, MHCConfig, exist_ok=True)
AutoModel.register(MHCConfig, modeling_mhc.MHCModel, exist_ok=True)
AutoModelForCausalLM.register(MHCConfig, modeling_mhc.MHCForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(MHCConfig, modeling_mhc.MHCForSequenceClassification, exist_ok=True)
_install_accelerate_fsdp2()  # Accelerate / Trainer FSDP2 keep the HC modules float32 (see hf_mhc.accelerate_fsdp2)

from .conversion import upcycle  # noqa: E402  (needs the classes registered above)
from .serving import register_with_transformers_serve  # noqa: E402

register_with_transformers_serve()  # hf-mhc serve: the server's model process (transformers >= 5.25) imports hf_mhc

__version__ = "0.1.0"
warn_if_untested("transformers")  # once, where the installed transformers is not among those tested


def apply_mhc_kernels(model, backend: str | None = None):
    """Run the hyper-connections of a transformers DeepSeek-V4, GLM-5-Next or HY-V4 model through ``hf_mhc.kernels``
    (see :func:`hf_mhc.monkey_patch.apply_mhc_kernels`). Imported on use: ``import hf_mhc`` works without Triton."""
    from .monkey_patch import apply_mhc_kernels as apply

    return apply(model, backend=backend)


__all__ = ["SUPPORTED_BACKBONES", "MHCConfig", *modeling_mhc.__all__, "apply_mhc_kernels", "upcycle"]
