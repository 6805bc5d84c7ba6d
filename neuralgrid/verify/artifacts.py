"""A model file's identity, as the catalog pins it (model_artifacts.sha256). Standard library only:
the referee's Python and the operator's CLI both name files by it."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: Path) -> str:
    """The file's sha256, read in chunks: a GGUF is often larger than memory wants to hold twice."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
