"""Packaging facts a user relies on: one version everywhere, install hints that work, the wheel
configuration, and the CI script still running the README's test command."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import poolkeeper
from poolkeeper import _version
from poolkeeper.integrations._common import MissingDependencyError, import_optional

ROOT = Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    tomllib = pytest.importorskip("tomli")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_version_is_written_once():
    py = _pyproject()
    assert "version" not in py["project"] and "version" in py["project"]["dynamic"]
    meta = py["tool"]["scikit-build"]["metadata"]["version"]
    assert meta["provider"] == "scikit_build_core.metadata.regex"
    assert meta["input"] == "src/poolkeeper/_version.py"
    assert poolkeeper.__version__ == _version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", poolkeeper.__version__)
    assert f"## {poolkeeper.__version__}" in (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")


def test_classifiers_cover_every_supported_python():
    py = _pyproject()
    assert py["project"]["requires-python"] == ">=3.10"
    classifiers = set(py["project"]["classifiers"])
    for minor in (10, 11, 12, 13):
        assert f"Programming Language :: Python :: 3.{minor}" in classifiers
    cibw = py["tool"]["cibuildwheel"]
    assert cibw["build"].split() == ["cp310-*", "cp311-*", "cp312-*", "cp313-*"]
    linux = cibw["linux"]
    assert linux["archs"] == ["x86_64", "aarch64"]
    assert linux["manylinux-x86_64-image"] == linux["manylinux-aarch64-image"] == "manylinux_2_28"
    assert "auditwheel repair" in linux["repair-wheel-command"]


def test_missing_framework_hint_names_a_package_that_installs():
    # The regression: the hint said pip install 'poolkeeper[torch]', an extra of a package that is
    # on no index, so the command failed.
    with pytest.raises(MissingDependencyError) as e:
        import_optional("poolkeeper_no_such_module", "poolkeeper.integrations.torch", "torch")
    assert "pip install torch" in str(e.value) and "poolkeeper[" not in str(e.value)
    with pytest.raises(MissingDependencyError, match="pip install cupy-cuda12x"):
        import_optional("poolkeeper_no_such_module", "poolkeeper.integrations.cupy", "cupy")


def test_no_install_hint_points_at_an_extra():
    for path in [ROOT / "README.md", *ROOT.joinpath("docs").glob("*.md"), *ROOT.joinpath("src").rglob("*.py")]:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"pip install '?poolkeeper\[", text), path


def test_ci_runs_the_readme_test_command_and_the_wheel_smoke_test():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "pip install '.[test]' && pytest" in readme
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python3 -m pip install -q '.[test]'\npython3 -m pytest -q\n" in ci
    assert "tools/build_wheels.sh" in ci
