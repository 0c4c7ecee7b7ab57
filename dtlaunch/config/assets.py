"""Where the built-in config groups and recipes are.

They live at the repository's top level (`configs/`, `recipes/`), beside the package, where a source
checkout or an editable install reads them; the wheel's build copies them into the package
(`dtlaunch/configs`, `dtlaunch/recipes`, see setup.py). Hydra's search path and the recipe symlinks
need a real directory, which every installed (not zipped) package has.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from dtlaunch.errors import ConfigError


def asset_dir(name: str) -> Path:
    """The built-in `configs` or `recipes` directory: inside the installed package, else beside it."""
    package = resources.files("dtlaunch")
    if not isinstance(package, Path):
        raise ConfigError(f"dtlaunch is not on the file system ({package}): install dtlaunch unzipped")
    for candidate in (package / name, package.parent / name):
        if candidate.is_dir():
            return candidate
    raise ConfigError(f"dtlaunch's built-in {name}/ is missing next to {package}: reinstall dtlaunch")
