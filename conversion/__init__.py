"""Upcycling residual checkpoints into mHC models (imported as ``hf_mhc.conversion``).

``upcycle`` converts a model in memory; ``convert_checkpoint`` (the ``hf-mhc convert`` command) streams a checkpoint
folder or Hub id into a new mHC checkpoint folder without loading the model.
"""

from .convert import ConversionReport, convert_checkpoint
from .errors import ConversionError, VerificationError
from .upcycle import is_hc_parameter, mhc_config_for, upcycle
from .verify import VerificationResult

__all__ = [
    "ConversionError",
    "ConversionReport",
    "VerificationError",
    "VerificationResult",
    "convert_checkpoint",
    "is_hc_parameter",
    "mhc_config_for",
    "upcycle",
]
