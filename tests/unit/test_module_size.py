"""No module grows past what one reader can hold: one job per module (issue 38).

The platform's modules stop at 600 lines; a module that reaches it is doing more than one thing and
is split along a seam it already has. Tests may run to 1,000: a test module is a list of cases
around shared fixtures and helpers, and cutting one mid-topic scatters those, but a ceiling still
keeps one from becoming where every new case lands.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MOST_LINES = {"neuralgrid": 600, "tests": 1000}


def too_long(folder: Path, most: int) -> list[str]:
    """The .py modules under `folder` longer than `most` lines, with their lengths."""
    lengths = {path: len(path.read_text().splitlines()) for path in folder.rglob("*.py")}
    return sorted(f"{path.relative_to(ROOT)}: {n} lines" for path, n in lengths.items() if n > most)


@pytest.mark.parametrize(("folder", "most"), MOST_LINES.items())
def test_no_module_is_too_long(folder: str, most: int) -> None:
    offenders = too_long(ROOT / folder, most)
    assert offenders == [], f"over {most} lines, to split along a seam: {offenders}"
