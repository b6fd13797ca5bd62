"""The `tensorrt_llm` model parameters both backends render from the build config (TRITON_ENGINE_PARAMETERS),
as the strings config.pbtxt carries."""

from __future__ import annotations

from pipeline.config.build_config import BuildConfig
from pipeline.config.vocab import TRITON_ENGINE_PARAMETERS


def pbtxt_flag(value: bool) -> str:
    # The backends' bool parsers accept true/false (and True/TRUE/1/...); lower case is the documented form.
    return "true" if value else "false"


def _pbtxt_value(value: object) -> str:
    if isinstance(value, bool):
        return pbtxt_flag(value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def engine_parameters(cfg: BuildConfig) -> dict[str, str]:
    """Parameter name -> value for every build-config field the engine model reads; an unset optional
    field (None) is left out so the backend's own default applies."""
    params = {}
    for field, name in TRITON_ENGINE_PARAMETERS.items():
        section, attr = field.split(".")
        value = getattr(getattr(cfg, section), attr)
        if value is not None:
            params[name] = _pbtxt_value(value)
    return params
