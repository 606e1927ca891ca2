"""HeadSplit's profile of a model, as `serve` reads it: the JSON file `edgespec profile-headsplit` writes
(decoding/training/profile_headsplit.py), shipped for the embedded model in config/profiles."""

from __future__ import annotations

import json
from pathlib import Path

PROFILES = Path(__file__).resolve().parents[1] / "config" / "profiles"


def load_profile(model_name: str, path: Path | None = None) -> dict | None:
    """The HeadSplit profile of a model (default: the one shipped in config/profiles), or None."""
    path = path or PROFILES / f"{model_name.lower()}-headsplit.json"
    return json.loads(path.read_text()) if path.exists() else None
