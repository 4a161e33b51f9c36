"""One version string: `composer_lightning.__version__` is the package's version (pyproject
reads it), the installed metadata says the same, and the changelog's newest release is it."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib

import pytest

import composer_lightning
from tests.helpers import ROOT


def test_pyproject_takes_its_version_from_the_package():
    from setuptools.config.pyprojecttoml import read_configuration

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert read_configuration(ROOT / "pyproject.toml")["project"]["version"] == (
        composer_lightning.__version__
    )


def test_the_installed_metadata_agrees():
    try:
        installed = importlib.metadata.version("composer-lightning")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("composer-lightning is not installed (setup.sh installs it)")
    assert installed == composer_lightning.__version__


def test_the_changelogs_newest_release_is_the_version():
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases and releases[0] == composer_lightning.__version__
