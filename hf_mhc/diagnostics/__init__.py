"""Stability diagnostics of mHC models: the mHC paper's gain measures, Sinkhorn residuals and stream collapse.

One module per part: the report itself (:mod:`hf_mhc.diagnostics.report`: :func:`stability_report`,
:func:`capture_hc_maps`, :func:`report_scalars`, :func:`format_report`), the plots (:mod:`hf_mhc.diagnostics.plots`:
:func:`plot_report`, :func:`overview_figure`, :func:`layer_figure`), the Trainer callback that logs the report every N
steps (:mod:`hf_mhc.diagnostics.callback`: :class:`MHCStabilityCallback`) and the ``hf-mhc inspect`` command
(:mod:`hf_mhc.diagnostics.cli`: :func:`inspect_main`, :func:`run_inspect`, :func:`add_inspect_arguments`). Every name
imports from ``hf_mhc.diagnostics``; those of the plots, the callback and the command on first use, so that measuring
imports neither matplotlib nor ``Trainer``. The other modules import the report; the report imports none of them.
"""

from __future__ import annotations

import importlib
from typing import Any

from .report import *  # noqa: F403  (the report: report.__all__)
from .report import __all__ as _REPORT_NAMES

# The names of the other modules of the package, and their modules, imported on first use.
_ELSEWHERE = {
    **dict.fromkeys(("layer_figure", "overview_figure", "plot_report"), "plots"),
    "MHCStabilityCallback": "callback",
    **dict.fromkeys(("add_inspect_arguments", "inspect_main", "run_inspect"), "cli"),
}


def __getattr__(name: str) -> Any:
    """The names of :data:`_ELSEWHERE`, imported from their own modules on first use."""
    if name in _ELSEWHERE:
        return getattr(importlib.import_module(f"{__name__}.{_ELSEWHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_ELSEWHERE})


__all__ = [*_REPORT_NAMES, *_ELSEWHERE]
