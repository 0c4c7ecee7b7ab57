"""Build hook: the top-level configs/ and recipes/ folders ship inside the wheel as dtlaunch/configs and
dtlaunch/recipes, where an installed dtlaunch finds them (dtlaunch/config/assets.py). Everything else
about the build is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ASSET_DIRS = ("configs", "recipes")


class BuildPyWithAssets(build_py):
    def run(self) -> None:
        super().run()
        here = Path(__file__).parent
        for name in ASSET_DIRS:
            dst = Path(self.build_lib) / "dtlaunch" / name
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(here / name, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildPyWithAssets})
