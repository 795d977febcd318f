"""The model card (``README.md``) of an upcycled mHC checkpoint: the Hub's metadata and how the model was made.

``hf-mhc convert`` and ``save_pretrained`` of an upcycled model (one whose config records ``upcycled_from``) write it.
Neither replaces a ``README.md`` it did not write: a card written here carries the sha256 of its own text in its
metadata (``hf_mhc_card_sha256``), and only a card whose text still matches it (hf-mhc's, unedited) is rewritten. A
card someone wrote or edited stays as it is.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from huggingface_hub import ModelCardData

from .common import looks_like_local_path

if TYPE_CHECKING:
    from .configuration_mhc import MHCConfig

CARD_FILE = "README.md"
TAGS = ("mhc", "hyper-connections", "hf-mhc")
DIGEST_KEY = "hf_mhc_card_sha256"
_DIGEST_LINE = re.compile(rf"^{DIGEST_KEY}: ([0-9a-f]{{64}})\n", re.MULTILINE)
# The comb bias of each residual map's function-preserving start (mhc_reference.function_preserving_hc_base).
_RESIDUAL_START = {
    "sinkhorn": "comb bias = {c:g}·I",
    "unconstrained": "comb = I",
    "identity": "streams carried by the identity",
    "permutations": "permutation weights peaked on the identity",
}


def source_name(name_or_path: str | os.PathLike) -> str | None:
    """What the card names as the source (``base_model``): a Hub id as given; for a local folder (also one that is
    gone since: a path, :func:`~hf_mhc.common.looks_like_local_path`) its name, or the repo id of a Hugging Face
    cache snapshot (``.../models--ORG--NAME/snapshots/REVISION``); never the path itself. ``None`` for no name (a
    model built from a config)."""
    text = os.fspath(name_or_path).strip()
    if not text:
        return None
    path = Path(text).expanduser()
    if not path.is_dir() and not looks_like_local_path(text):
        return text
    path = path.resolve()
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    return path.name or None


def model_card(config: MHCConfig, name: str, *, made_by: str, weights: str, verification: str,
               auto_class: str = "AutoModelForCausalLM") -> str:
    """The card of the mHC model ``config`` (its ``upcycled_from`` set) saved as folder ``name``: ``made_by`` names
    what wrote it, ``weights`` says their dtypes, ``verification`` the outcome of the comparison with the source."""
    backbone = config.backbone_config
    architecture = (backbone.architectures or [f"{backbone.model_type} causal LM"])[0]
    metadata = ModelCardData(base_model=config.upcycled_from, library_name="transformers", tags=list(TAGS))
    residual = _RESIDUAL_START[config.hc_residual_map].format(c=config.hc_init_comb_diag)
    load = f'model = {auto_class}.from_pretrained("{name}"'
    text = "\n".join([
        "---",
        metadata.to_yaml(),
        "---",
        "",
        f"# {name}",
        "",
        f"A Manifold-Constrained Hyper-Connections (mHC, arXiv 2512.24880) model with **hc_mult = {config.hc_mult}** "
        f"residual streams, upcycled from `{config.upcycled_from}` ({architecture}, {backbone.num_hidden_layers} "
        f"layers, hidden size {backbone.hidden_size}). Written by {made_by}.",
        "",
        f"- **Source:** `{config.upcycled_from}`",
        f"- **Streams:** hc_mult = {config.hc_mult}, residual map `{config.hc_residual_map}`, "
        f"{config.hc_sinkhorn_iters} Sinkhorn iterations, hc_eps = {config.hc_eps:g}",
        f"- **Initialisation:** hc_init = `{config.hc_init}`. Every stream starts as a copy of the embedding; "
        f"pre = 1/n; post biases in pairs ±k·{config.hc_init_post_delta:g} with mean(post) = 1; {residual}; the head "
        f"averages the streams; the token-dependent part is off (fn = 0, scale = {config.hc_init_dynamic_scale:g}). "
        "Until it is trained the model computes the source's function.",
        f"- **Weights:** {weights}",
        f"- **Verification:** {verification}",
        "",
        "## Usage",
        "",
        "With hf-mhc installed:",
        "",
        "```python",
        "import hf_mhc  # registers the mHC classes with the Auto classes",
        f"from transformers import {auto_class}",
        "",
        f"{load})",
        "```",
        "",
        "Without it, from the modeling code saved in the folder:",
        "",
        "```python",
        f"from transformers import {auto_class}",
        "",
        f"{load}, trust_remote_code=True)",
        "```",
        "",
    ])
    return text.replace("\n---\n", f"\n{DIGEST_KEY}: {_digest(text)}\n---\n", 1)


def is_hf_mhc_card(text: str) -> bool:
    """Whether ``text`` is a card :func:`model_card` wrote, unedited since: its recorded sha256 is that of the rest."""
    line = _DIGEST_LINE.search(text)
    return line is not None and line.group(1) == _digest(text[: line.start()] + text[line.end() :])


def is_hf_mhc_card_file(path: Path) -> bool:
    """Whether ``path`` is a regular file (not a link, a folder or unreadable) holding an unedited hf-mhc card
    (:func:`is_hf_mhc_card`)."""
    try:
        return path.is_file() and not path.is_symlink() and is_hf_mhc_card(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return False


def may_write_card(folder: Path) -> bool:
    """Whether a card may be written into ``folder``: it has no ``README.md``, or hf-mhc's own, unedited (never
    through a link, nor over a folder or an unreadable file)."""
    card = folder / CARD_FILE
    return not os.path.lexists(card) or is_hf_mhc_card_file(card)


def kept_card_message(folder: Path) -> str:
    """The one line saying that ``folder``'s ``README.md`` was left as it is."""
    return (f"{folder / CARD_FILE} was not written by hf-mhc (or was edited since), so it was left as it is; delete it "
            "to get hf-mhc's model card.")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


__all__ = [
    "CARD_FILE", "is_hf_mhc_card", "is_hf_mhc_card_file", "kept_card_message", "may_write_card", "model_card",
    "source_name",
]
