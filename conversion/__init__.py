"""Upcycling residual checkpoints into mHC models (imported as ``hf_mhc.conversion``)."""

from .upcycle import is_hc_parameter, mhc_config_for, upcycle

__all__ = ["is_hc_parameter", "mhc_config_for", "upcycle"]
