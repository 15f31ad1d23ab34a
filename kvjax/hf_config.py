"""Parse a Hugging Face ``config.json`` dict into a `ModelSpec` (the readers live in ``kvjax.hf``).

Kept for the names callers already use: ``parse_hf_config`` and ``supported_model_types``. It
imports ``kvjax.spec``, which imports ``kvjax.hf``; neither imports this module, so there is no
import cycle.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvjax.hf import supported_model_types
from kvjax.hf.recurrent import gdn_state_spec
from kvjax.spec import ModelSpec

__all__ = ["gdn_state_spec", "parse_hf_config", "supported_model_types"]


def parse_hf_config(config: Mapping[str, Any], *, name: str | None = None) -> ModelSpec:
    """Build a `ModelSpec` from a Hugging Face ``config.json`` dict (``ModelSpec.from_hf_config``)."""
    return ModelSpec.from_hf_config(config, name=name)
