"""Method cards: one per registered algorithm, each with its differences from Composer, all in the docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from composerjax import registry

ROOT = Path(__file__).resolve().parents[2]
CARDS = ROOT / "docs" / "algorithms"
CARD_FILES = sorted(path for path in CARDS.glob("*.md") if path.name != "README.md")


def test_every_registered_algorithm_has_a_card_listed_in_the_catalogue_and_the_site():
    catalogue = (CARDS / "README.md").read_text()
    site = (ROOT / "mkdocs.yml").read_text()
    for name in registry.algorithms.names():
        card = CARDS / f"{name}.md"
        assert card.exists(), f"no method card docs/algorithms/{name}.md for the registered algorithm {name!r}"
        assert f"]({name}.md)" in catalogue, f"docs/algorithms/README.md does not list {name}"
        assert f"algorithms/{name}.md" in site, f"mkdocs.yml does not list algorithms/{name}.md"
    assert {path.stem for path in CARD_FILES} == set(registry.algorithms.names())


@pytest.mark.parametrize("card", CARD_FILES, ids=[path.stem for path in CARD_FILES])
def test_each_card_says_how_it_differs_from_composer(card):
    text = card.read_text()
    sections = re.findall(r"^## Differences from Composer\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert len(sections) == 1, f"{card.name}: expected one '## Differences from Composer' section"
    body = sections[0].strip()
    assert body == "None." or body.startswith("- "), (
        f"{card.name}: the section must say 'None.' or list each difference as a bullet, got {body[:80]!r}")
