"""Check rendered config.pbtxt files with Triton's own schema (tritonclient's model_config_pb2), before a
server ever sees them: a parse error or a miswired ensemble becomes a ConfigError naming the model, the
field and the value."""

from __future__ import annotations

import re
from typing import Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pipeline.errors import ConfigError

_HINT = "Fix the template in pipeline/serving/templates or the build config value it came from."
_FIELD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*:\s*(.*)$")


def _field_at(text: str, line_no: int, column: int) -> tuple[str, str]:
    """The `field: value` written at a 1-based line (the last one starting before `column`)."""
    lines = text.splitlines()
    if not 1 <= line_no <= len(lines):
        return "?", "?"
    line = lines[line_no - 1]
    head = line[: max(column, 1)] if column else line
    fields = list(re.finditer(r"([A-Za-z_][A-Za-z0-9_]*)\s*:", head)) or list(
        re.finditer(r"([A-Za-z_][A-Za-z0-9_]*)\s*:", line)
    )
    if not fields:
        return "?", line.strip()
    name = fields[-1].group(1)
    rest = line[fields[-1].end() :].strip()
    value = re.split(r"[\s}\],]", rest, maxsplit=1)[0] if rest else ""
    return name, value


def parse_model_config(model: str, text: str) -> Any:
    """The ModelConfig message of a rendered config.pbtxt; raises ConfigError on any schema violation."""
    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as err:
        line_no, column = err.GetLine() or 0, err.GetColumn() or 0
        field, value = _field_at(text, line_no, column)
        message = re.sub(r"^\d+:\d+ : ('.*': )?", "", str(err))
        raise ConfigError(
            f"model '{model}': config.pbtxt line {line_no}: field {field} value {value!r} is "
            f"invalid ({message})",
            hint=_HINT,
        ) from None
    if config.name and config.name != model:
        raise ConfigError(
            f"model '{model}': field name value {config.name!r} must equal the folder name {model!r}",
            hint=_HINT,
        )
    if config.max_batch_size < 0:
        raise ConfigError(
            f"model '{model}': field max_batch_size value {config.max_batch_size} must be >= 0", hint=_HINT
        )
    for group in config.instance_group:
        if group.count < 1:
            raise ConfigError(
                f"model '{model}': field instance_group.count value {group.count} must be >= 1", hint=_HINT
            )
    return config


def check_ensemble(configs: dict[str, Any], ensemble: str = "ensemble") -> None:
    """Every step names a model of the repository and tensors that model has; every tensor a step reads
    is an ensemble input or an earlier step's output; every ensemble output is produced."""
    config = configs[ensemble]
    available = {i.name for i in config.input}
    for step in config.ensemble_scheduling.step:
        where = f"model '{ensemble}': step {step.model_name!r}"
        target = configs.get(step.model_name)
        if target is None:
            raise ConfigError(
                f"{where}: field model_name value {step.model_name!r} is not a model of the "
                f"repository ({', '.join(sorted(configs))})",
                hint=_HINT,
            )
        inputs, outputs = {i.name for i in target.input}, {o.name for o in target.output}
        for key, value in step.input_map.items():
            if key not in inputs:
                raise ConfigError(
                    f"{where}: field input_map key {key!r} is not an input of {step.model_name}", hint=_HINT
                )
            if value not in available:
                raise ConfigError(
                    f"{where}: field input_map value {value!r} is neither an ensemble input nor "
                    "an earlier step's output",
                    hint=_HINT,
                )
        required = {i.name for i in target.input if not i.optional}
        missing = required - set(step.input_map)
        if missing:
            raise ConfigError(
                f"{where}: required input(s) {', '.join(sorted(missing))} of {step.model_name} "
                "are not mapped",
                hint=_HINT,
            )
        for key, value in step.output_map.items():
            if key not in outputs:
                raise ConfigError(
                    f"{where}: field output_map key {key!r} is not an output of {step.model_name}", hint=_HINT
                )
            available.add(value)
    for output in config.output:
        if output.name not in available:
            raise ConfigError(
                f"model '{ensemble}': output {output.name!r} is produced by no step", hint=_HINT
            )
