"""requirements.lock, what `make setup` installs, agrees with pyproject.toml (docs/architecture.md, set-up)."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LOCKED_EXTRAS = ("dev", "bench", "retro")  # the Makefile's LOCK_EXTRAS
tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")


def locked_versions(text: str) -> dict[str, Version]:
    """Name -> pinned version of every `name==version` line of a requirements file."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = Version(version)
    return pins


def project_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + [
        s for extra in LOCKED_EXTRAS for s in project["optional-dependencies"][extra]
    ]
    return [Requirement(spec) for spec in specs]


LOCK = locked_versions((ROOT / "requirements.lock").read_text())


@pytest.mark.parametrize("requirement", project_requirements(), ids=str)
def test_every_requirement_is_pinned_within_its_specifier(requirement: Requirement) -> None:
    name = canonicalize_name(requirement.name)
    assert name in LOCK, f"{requirement} is in pyproject.toml but not in requirements.lock: run `make lock`"
    assert requirement.specifier.contains(LOCK[name], prereleases=True), (
        f"requirements.lock pins {name}=={LOCK[name]}, outside pyproject.toml's {requirement}: run `make lock`"
    )


def test_torch_is_the_local_cpu_build() -> None:
    assert LOCK["torch"] == Version("2.13.0+cpu")
    assert "--find-links /opt/wheels" in (ROOT / "requirements.lock").read_text().splitlines()


def test_locked_versions_reads_pins_and_skips_options_and_comments() -> None:
    text = "--find-links /opt/wheels\n\nFoo_Bar==1.2\n    # via x\ntorch==2.13.0+cpu  # cpu\n"
    assert locked_versions(text) == {"foo-bar": Version("1.2"), "torch": Version("2.13.0+cpu")}
