"""Errors of checkpoint conversion: each message says what is wrong and what to do about it."""

from __future__ import annotations


class ConversionError(ValueError):
    """Bad input or a failed check. Raised before anything is written to the output folder."""


class VerificationError(ConversionError):
    """The converted checkpoint does not reproduce the source's logits within the dtype's tolerance."""


__all__ = ["ConversionError", "VerificationError"]
