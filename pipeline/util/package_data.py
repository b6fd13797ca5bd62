"""Where the installed `pipeline` package and its data files live."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]
# The folder that holds the `pipeline` package: what a subprocess needs on PYTHONPATH to import it.
IMPORT_ROOT = PACKAGE_DIR.parent
DATA_DIR = PACKAGE_DIR / "data"
