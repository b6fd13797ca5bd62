"""Print pyproject.toml's dependencies as requirements for an environment that already holds some of them
(the TensorRT-LLM serving image: see Dockerfile). A package installed here stays at its installed version,
with the extras pyproject asks for (TensorRT-LLM pins its own torch and transformers); the others get
pyproject's range.

    python3 scripts/image_requirements.py > requirements.txt && pip install -r requirements.txt
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import tomllib

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
NAME_AND_EXTRAS = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?")


def requirements(dependencies: list[str]) -> list[str]:
    lines = []
    for dependency in dependencies:
        match = NAME_AND_EXTRAS.match(dependency)
        assert match is not None, f"not a requirement: {dependency!r}"
        name, extras = match.groups()
        try:
            lines.append(f"{name}{extras or ''}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            lines.append(dependency)
    return lines


def main() -> None:
    print("\n".join(requirements(tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"])))


if __name__ == "__main__":
    main()
