"""docs/reference.md is the code's reference (rendered by pgq.reference),
and it names every PGQ_* variable the code reads."""

from __future__ import annotations

import re
from pathlib import Path

from pgq.reference import ENVIRONMENT, render

ROOT = Path(__file__).resolve().parent.parent


def test_the_reference_page_is_current():
    page = (ROOT / "docs" / "reference.md").read_text()
    assert page == render(), "run: python -m pgq.reference > docs/reference.md"


def test_every_pgq_variable_is_documented():
    used = set()
    for folder in ("pgq", "cluster", "bench", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            used |= set(re.findall(r"\bPGQ_[A-Z][A-Z_]*[A-Z]\b", path.read_text()))
    documented = {name for name, _ in ENVIRONMENT}
    assert used - documented == set(), "add them to pgq.reference.ENVIRONMENT"
    assert documented - used == set(), "documented but never read"
