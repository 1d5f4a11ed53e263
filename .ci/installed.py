"""Exit 0 when this checkout's install is already in place: kdaserve installed editable from
this directory, with the pyproject.toml the stamp recorded, and instructor at the version
given (.ci/run's pin). .ci/run then skips pip (a resolve of the whole test extra and an
editable rebuild, every run); `VERSION --stamp` records the current pyproject.toml after an
install.

    python3 .ci/installed.py INSTRUCTOR_VERSION [--stamp]"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAMP = Path(sysconfig.get_paths()["purelib"]) / "kdaserve-ci.stamp"


def wanted() -> str:
    return f"{hashlib.sha256((ROOT / 'pyproject.toml').read_bytes()).hexdigest()} {ROOT}\n"


def installed(instructor_version: str) -> bool:
    try:
        url = json.loads(md.distribution("kdaserve").read_text("direct_url.json") or "{}")
        instructor = md.version("instructor")
    except md.PackageNotFoundError:
        return False
    here = url.get("url") == ROOT.as_uri() and url.get("dir_info", {}).get("editable")
    return bool(here) and instructor == instructor_version and STAMP.is_file() \
        and STAMP.read_text() == wanted()


if __name__ == "__main__":
    if sys.argv[2:] == ["--stamp"]:
        STAMP.write_text(wanted())
        sys.exit(0)
    sys.exit(0 if installed(sys.argv[1]) else 1)
