"""Deploy values as users write them (a YAML file plus --value overrides), and the CPU image's pins."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from pipeline.deploy.values import load_values
from pipeline.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_a_values_file_and_overrides_combine_with_yaml_typed_values(tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text("image: registry.example/llmpipe:cpu\nautoscaling:\n  kind: keda\n  max_replicas: 2\n")
    values = load_values(path, ("autoscaling.max_replicas=8", "resources.gpus_per_node=4", "openai=false"))
    assert values.image == "registry.example/llmpipe:cpu"
    assert (values.autoscaling.kind, values.autoscaling.max_replicas) == ("keda", 8)
    assert values.resources.gpus_per_node == 4 and values.openai is False


@pytest.mark.parametrize(
    ("text", "overrides", "message"),
    [
        ("- a list\n", (), "top level must be a mapping of values, got list"),
        ("resources:\n  cpu: '4'\n", ("resources.cpu.limit=2",), "'cpu' is not a section"),
        ("", ("name=Not_A_Name",), "name: String should match pattern"),
        ("", ("resources.memory=lots",), "resources.memory: String should match pattern"),
        ("autoscaling:\n  kind: vpa\n", (), "autoscaling.kind: Input should be 'hpa', 'keda' or 'none'"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_field(
    tmp_path: Path, text: str, overrides: tuple[str, ...], message: str
) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_values(path, overrides)
    assert message in err.value.message
    assert "\n" not in err.value.message


def test_the_cpu_image_pins_what_the_makefile_installs() -> None:
    makefile = (REPO_ROOT / "Makefile").read_text()
    dockerfile = (REPO_ROOT / "Dockerfile.cpu").read_text()
    torch = re.search(r"^TORCH \?= (\S+)$", makefile, re.M)
    pytriton = re.search(r"nvidia-pytriton==\S+", makefile)
    assert torch is not None and pytriton is not None
    assert f"ARG TORCH={torch.group(1)}\n" in dockerfile
    assert f"--no-deps {pytriton.group(0)}" in dockerfile


def test_the_help_names_every_value() -> None:
    from click.testing import CliRunner

    from pipeline.cli.main import cli
    from pipeline.deploy.values import DeployValues

    shown = CliRunner().invoke(cli, ["deploy", "k8s", "--help"], terminal_width=200).output
    for name, field in DeployValues.model_fields.items():
        assert name in shown
        section = field.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            listed = re.search(rf"{name}\.\{{([^}}]*)\}}", shown)
            assert listed is not None, name
            assert {n.strip() for n in listed.group(1).split(",")} == set(section.model_fields), name
