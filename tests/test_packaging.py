"""The distribution users install holds the whole package, with its type hints marked."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.no_stream_check
def test_the_wheel_holds_every_module_and_the_typed_marker(tmp_path):
    """A subpackage left out of the build (a ``packages.find`` pattern) would pass every other
    test, which import the source tree; type checkers read a package's hints only where
    ``py.typed`` is installed with it (PEP 561). Built without isolation (no download), with
    the setuptools of the dev extra."""
    source = tmp_path / "source"  # a copy: no build/ folder left over from another build
    ignored = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(
        ROOT / "lightning_offload_optim", source / "lightning_offload_optim", ignore=ignored
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*build, "--wheel-dir", str(tmp_path), str(source)], check=True)
    (wheel,) = tmp_path.glob("lightning_offload_optim-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packaged = {
            name for name in archive.namelist() if name.startswith("lightning_offload_optim/")
        }
    package = ROOT / "lightning_offload_optim"
    expected = {
        path.relative_to(ROOT).as_posix()
        for path in [*package.rglob("*.py"), package / "py.typed"]
        if "__pycache__" not in path.parts
    }
    assert packaged == expected
