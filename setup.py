"""Maps the repository's folders onto the ``dsv4`` import package (see pyproject.toml).

core/ -> dsv4, specs/ -> dsv4.specs, backends/ -> dsv4.backends, conformance/ -> dsv4.conformance;
every sub-folder with an ``__init__.py`` becomes a sub-package. Works for wheel and editable installs.
"""
from pathlib import Path

from setuptools import setup

ROOTS = {"dsv4": "core", "dsv4.specs": "specs", "dsv4.backends": "backends", "dsv4.conformance": "conformance"}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages, package_dir = [], {}
    here = Path(__file__).parent
    for name, folder in ROOTS.items():
        for init in sorted((here / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(here / folder)
            pkg = ".".join([name, *rel.parts]) if rel.parts else name
            packages.append(pkg)
            package_dir[pkg] = str(init.parent.relative_to(here))
    return packages, package_dir


_pkgs, _dirs = _packages()
setup(packages=_pkgs, package_dir=_dirs)
