"""Render pipeline/serving/templates into a Triton model repository for one build config and engine (the
`package` stage's work). Strict: every `${placeholder}` comes from the build config, an unfilled one is an
error (never a silent `${x}`), and every config.pbtxt is parsed with Triton's own protobuf schema and
its ensemble wiring checked before anything is written.

Layout (relocatable: paths inside are relative to each model's version folder), by serving.interface:

inflight_batcher_llm (templates/<model>/):

    ensemble/config.pbtxt, ensemble/1/                                       (serving.ensemble=triton, the default)
    ensemble/config.pbtxt, ensemble/1/{model.py, tokenizer/}                 (serving.ensemble=bls)
    preprocessing/config.pbtxt, preprocessing/1/{model.py, tokenizer/}
    tensorrt_llm/config.pbtxt, tensorrt_llm/1/{model.py, engine/}      (torch: engine hard-linked in)
    postprocessing/config.pbtxt, postprocessing/1/{model.py, tokenizer/}
    tensorrt_llm_bls/config.pbtxt, tensorrt_llm_bls/1/{model.py, tokenizer/}
    tensorrt_llm_draft/config.pbtxt, tensorrt_llm_draft/1/                (trtllm draft-target only)

serving.ensemble=bls keeps the ensemble's tensors (templates/ensemble) and serves them with the BLS's code
and parameters (templates/tensorrt_llm_bls): Triton's ensemble scheduler checks a client's cancellation only
between steps, never inside the long tensorrt_llm step, while the BLS stops its engine request.

TensorRT-LLM's draft-target speculation (trtllm, speculative.mode=draft_model) runs in the BLS: the draft
engine is served as `tensorrt_llm_draft` (the tensorrt_llm template, like tensorrtllm_backend's copy of it)
and the BLS names it in `tensorrt_llm_draft_model_name`. The torch engine drafts for itself: no extra model.

llmapi (templates/llmapi/<model>/, TensorRT-LLM's all_models/llmapi), torch backend:

    tensorrt_llm/config.pbtxt, tensorrt_llm/1/{model.py, model.yaml, engine/}   (engine hard-linked in, its
                                                                                  tokenizer inside)

The trtllm_pytorch backend's llmapi repository takes the same config.pbtxt (without parameters, as upstream's)
and is written by trtllm_pytorch.py beside this module.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pipeline.artifacts import MANIFEST_NAME, link_tree
from pipeline.config.build_config import BuildConfig
from pipeline.errors import ConfigError, MissingArtifactError
from pipeline.serving.repository.engine_parameters import engine_parameters, pbtxt_flag
from pipeline.serving.repository.pbtxt import check_ensemble, parse_model_config

MODELS = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")
ENSEMBLE_MODEL = "ensemble"
BLS_MODEL = "tensorrt_llm_bls"
DRAFT_MODEL = "tensorrt_llm_draft"
TOKENIZER_MODELS = ("preprocessing", "postprocessing", BLS_MODEL)
LLMAPI_TEMPLATES = "llmapi"  # templates/llmapi/tensorrt_llm: the one model of serving.interface=llmapi
ENGINE_MODEL = "tensorrt_llm"
TEMPLATE_NAME = "config.pbtxt.tmpl"
MODEL_YAML = "model.yaml"
# How often the engine model asks Triton whether clients went away (its cancellation_check_period_ms).
CANCELLATION_CHECK_PERIOD_MS = 50
ENGINE_SUBDIR = "engine"
TOKENIZER_SUBDIR = "tokenizer"
# Who answers the llmapi model's tensors, in its config.pbtxt's header (the llmapi backends).
LLMAPI_ENGINE_COMMENT = {
    "torch": "# Served by llmpipe's torch engine. image_url and lora_* are refused with an error naming the input:\n"
    "# the torch engine serves text-only models without adapters.",
    "trtllm_pytorch": "# Served by TensorRT-LLM's own llmapi model.py from the serving image (1/model.py loads it) on the\n"
    "# checkpoint in 1/checkpoint.",
}


def templates_dir() -> Path:
    """The model repository templates, shipped as package data beside this package."""
    templates = Path(__file__).resolve().parents[1] / "templates"
    if not (templates / "ensemble" / TEMPLATE_NAME).is_file():
        raise MissingArtifactError(
            f"the model repository templates are missing from {templates}",
            hint="Reinstall llmpipe: the templates are package data of pipeline.serving.",
        )
    return templates


def template_files() -> dict[str, Path]:
    """Every template file by its path under the templates folder: what a packaged repository was rendered
    from, so that a changed template (a new llmpipe) renders the repository again instead of reusing it."""
    templates = templates_dir()
    return {
        path.relative_to(templates).as_posix(): path
        for path in sorted(templates.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def _pbtxt_string(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def parameters_block(parameters: dict[str, str]) -> str:
    """`parameters { key: ... value: { string_value: ... } }` lines, one per parameter, sorted."""
    return "\n".join(
        f'parameters {{ key: "{_pbtxt_string(k)}" value: {{ string_value: "{_pbtxt_string(v)}" }} }}'
        for k, v in sorted(parameters.items())
    )


def torch_parameters(cfg: BuildConfig) -> dict[str, str]:
    """The torch engine model's parameters: tensorrtllm_backend's keys wherever the concept exists."""
    serving = cfg.serving
    params = {
        **engine_parameters(cfg),
        "device": cfg.engine.device,
        # The engine's own admission bound: what runs plus what Triton may queue.
        "max_pending_requests": str(cfg.engine.max_batch_size + serving.max_queue_size),
        "stats_check_period_ms": "100",
        "request_timeout_s": repr(float(serving.request_timeout_s)),
        "stream_interval": str(serving.stream_interval),
    }
    if serving.interface == "llmapi":
        # The engine path and the cancellation period are model.yaml keys there (upstream's home for
        # them); the model tokenizes and detokenizes itself.
        params["add_special_tokens"] = pbtxt_flag(serving.add_special_tokens)
        params["skip_special_tokens"] = pbtxt_flag(serving.skip_special_tokens)
    else:
        params["gpt_model_path"] = ENGINE_SUBDIR
        params["cancellation_check_period_ms"] = str(CANCELLATION_CHECK_PERIOD_MS)
    return params


@dataclass(frozen=True)
class DraftEngine:
    """The draft model of TensorRT-LLM's draft-target flow: its build config and the engine path the
    server opens."""

    cfg: BuildConfig
    engine_dir: Path


def serves_draft_model(cfg: BuildConfig) -> bool:
    return cfg.backend == "trtllm" and cfg.speculative.mode == "draft_model"


def draft_engine(cfg: BuildConfig, *, require_built: bool = False) -> DraftEngine:
    """speculative.draft_config's engine (the path is read like the torch build reads it: from the
    current directory); with `require_built`, MissingArtifactError when it was never built."""
    from pipeline.config.workdir import draft_engine_dir

    return DraftEngine(*draft_engine_dir(cfg, require_built=require_built))


def template_values(cfg: BuildConfig, engine_param_path: Path | None = None) -> dict[str, str]:
    """Every placeholder the templates may use, from the build config."""
    serving, engine = cfg.serving, cfg.engine
    drafting = serves_draft_model(cfg)
    values = {
        "tensorrt_llm_model_name": "tensorrt_llm",
        "tensorrt_llm_draft_model_name": DRAFT_MODEL if drafting else "",
        "num_draft_tokens": str(cfg.speculative.max_draft_len) if drafting else "0",
        "logits_datatype": "TYPE_FP32",
        "triton_backend": "python",
        "triton_max_batch_size": str(serving.triton_max_batch_size or engine.max_batch_size),
        "decoupled_mode": pbtxt_flag(serving.decoupled),
        "max_queue_delay_microseconds": str(serving.max_queue_delay_microseconds),
        "max_queue_size": str(serving.max_queue_size),
        "preprocessing_instance_count": str(serving.preprocessing_instance_count),
        "postprocessing_instance_count": str(serving.postprocessing_instance_count),
        "bls_instance_count": str(serving.bls_instance_count),
        "tokenizer_dir": TOKENIZER_SUBDIR,
        "add_special_tokens": pbtxt_flag(serving.add_special_tokens),
        "skip_special_tokens": pbtxt_flag(serving.skip_special_tokens),
        "exclude_input_in_output": pbtxt_flag(serving.exclude_input_in_output),
        "max_input_len": str(engine.max_input_len),
        "max_seq_len": str(engine.max_seq_len),
        "engine_subdir": ENGINE_SUBDIR,
        "cancellation_check_period_ms": str(CANCELLATION_CHECK_PERIOD_MS),
        "llmapi_engine_comment": LLMAPI_ENGINE_COMMENT.get(cfg.backend, ""),
    }
    if cfg.backend == "trtllm":
        from pipeline.backends.trtllm.triton_params import tensorrt_llm_header, tensorrt_llm_parameters

        values.update(tensorrt_llm_header(cfg))
        parameters = tensorrt_llm_parameters(cfg, engine_param_path or Path(ENGINE_SUBDIR))
    elif cfg.backend == "trtllm_pytorch":
        parameters = {}  # as upstream's llmapi config.pbtxt: model.yaml carries every setting
    else:
        parameters = torch_parameters(cfg)
    values["tensorrt_llm_parameters"] = parameters_block(parameters)
    return values


def render_template(model: str, text: str, values: dict[str, str]) -> str:
    """Substitute strictly; an unknown or malformed placeholder is a ConfigError naming the model."""
    try:
        rendered = string.Template(text).substitute(values)
    except KeyError as err:
        raise ConfigError(
            f"model '{model}': template placeholder ${{{err.args[0]}}} has no value in the build config",
            hint=f"Fill it in pipeline.serving.repository.render.template_values or fix "
            f"pipeline/serving/templates/{model}/{TEMPLATE_NAME}.",
        ) from None
    except ValueError as err:
        raise ConfigError(f"model '{model}': malformed placeholder in {TEMPLATE_NAME} ({err})") from None
    if "${" in rendered:
        line = next(ln for ln in rendered.splitlines() if "${" in ln)
        raise ConfigError(f"model '{model}': an unfilled placeholder survived rendering: {line.strip()!r}")
    return rendered


def _check_engine_dir(cfg: BuildConfig, engine_dir: Path) -> None:
    config = engine_dir / "config.json"
    if not config.is_file():
        raise MissingArtifactError(
            f"{engine_dir} has no config.json: not an engine directory",
            hint="Run `llmpipe engine CONFIG` (or `llmpipe build CONFIG`) first.",
        )
    if cfg.backend == "torch":
        from pipeline.runtime.engine_config import load_engine_config

        load_engine_config(engine_dir)  # the same validation the server runs at load, now
    else:
        try:
            json.loads(config.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ConfigError(
                f"{config}: not valid JSON ({err}); Triton would fail with parse_error.101"
            ) from None
    if not (engine_dir / TOKENIZER_SUBDIR).is_dir():
        raise MissingArtifactError(
            f"{engine_dir / TOKENIZER_SUBDIR} is missing: the repository needs the engine's tokenizer",
            hint="Rebuild the engine with `llmpipe build CONFIG --force`.",
        )


def _read_template(templates: Path, model: str) -> str:
    path = templates / model / TEMPLATE_NAME
    if not path.is_file():
        raise MissingArtifactError(f"template {path} is missing")
    return path.read_text(encoding="utf-8")


def render_configs(
    cfg: BuildConfig,
    templates: Path,
    engine_param_path: Path | None = None,
    draft: DraftEngine | None = None,
) -> dict[str, str]:
    """model name -> rendered, parsed and cross-checked config.pbtxt text. Writes nothing. `draft` (trtllm
    draft-target only) defaults to speculative.draft_config's engine."""
    values = template_values(cfg, engine_param_path)
    if cfg.serving.interface == "llmapi":
        texts = {ENGINE_MODEL: (f"{LLMAPI_TEMPLATES}/{ENGINE_MODEL}", values)}
    else:
        texts = {model: (model, values) for model in MODELS}
    if serves_draft_model(cfg):
        from pipeline.backends.trtllm.triton_params import tensorrt_llm_parameters

        draft = draft or draft_engine(cfg)
        # The target's deployment (batching, decoupled) with the draft engine's own parameters.
        draft_values = {
            **values,
            "tensorrt_llm_model_name": DRAFT_MODEL,
            "tensorrt_llm_parameters": parameters_block(tensorrt_llm_parameters(draft.cfg, draft.engine_dir)),
        }
        texts[DRAFT_MODEL] = ("tensorrt_llm", draft_values)
    rendered, parsed = {}, {}
    for model, (template, model_values) in texts.items():
        rendered[model] = render_template(model, _read_template(templates, template), model_values)
        parsed[model] = parse_model_config(model, rendered[model])
    if ENSEMBLE_MODEL in parsed:
        check_ensemble(parsed)  # the wiring stays checked: serving.ensemble=triton serves it as it is
        if cfg.serving.ensemble == "bls":
            rendered[ENSEMBLE_MODEL] = bls_ensemble_config(parsed[ENSEMBLE_MODEL], parsed[BLS_MODEL])
            parse_model_config(ENSEMBLE_MODEL, rendered[ENSEMBLE_MODEL])
    return rendered


def bls_ensemble_config(ensemble: Any, bls: Any) -> str:
    """serving.ensemble=bls: the ensemble's name and tensors, with the BLS's backend, transaction policy,
    parameters and instances instead of Triton's ensemble scheduling."""
    config = model_config_pb2.ModelConfig()
    config.CopyFrom(ensemble)
    config.ClearField("platform")
    config.ClearField("ensemble_scheduling")
    config.backend = bls.backend
    config.model_transaction_policy.CopyFrom(bls.model_transaction_policy)
    for key, value in bls.parameters.items():
        config.parameters[key].CopyFrom(value)
    config.instance_group.extend(bls.instance_group)
    header = (
        "# Rendered by `llmpipe package` (serving.ensemble=bls): the tensors of "
        f"pipeline/serving/templates/{ENSEMBLE_MODEL}/{TEMPLATE_NAME},\n"
        f"# served by the code and parameters of pipeline/serving/templates/{BLS_MODEL}: one Python model "
        "tokenizes, calls\n# tensorrt_llm and detokenizes, and stops the engine request of a client that "
        "cancels. serving.ensemble=triton\n# renders Triton's ensemble scheduler "
        "(preprocessing -> tensorrt_llm -> postprocessing) instead.\n"
    )
    return header + text_format.MessageToString(config)


def _tokenizer_models(cfg: BuildConfig) -> tuple[str, ...]:
    if cfg.serving.interface == "llmapi":
        return ()
    return (*TOKENIZER_MODELS, *((ENSEMBLE_MODEL,) if cfg.serving.ensemble == "bls" else ()))


def _model_shim(cfg: BuildConfig, templates: Path, model: str) -> Path:
    """The model.py a model's version folder gets (absent: the model has none)."""
    code = BLS_MODEL if model == ENSEMBLE_MODEL and cfg.serving.ensemble == "bls" else model
    return templates / code / "1" / "model.py"


def repository_models(cfg: BuildConfig) -> list[str]:
    """The models `llmpipe package` writes for `cfg`, in order."""
    if cfg.serving.interface == "llmapi":
        return [ENGINE_MODEL]
    return [*MODELS, *([DRAFT_MODEL] if serves_draft_model(cfg) else [])]


def _write_llmapi_model(cfg: BuildConfig, templates: Path, version: Path) -> None:
    """model.py and model.yaml of the llmapi model (its config.pbtxt is written with the others)."""
    source = templates / LLMAPI_TEMPLATES / ENGINE_MODEL / "1"
    # a copy: the stub writes __pycache__ beside it
    shutil.copyfile(source / "model.py", version / "model.py")
    text = (source / f"{MODEL_YAML}.tmpl").read_text(encoding="utf-8")
    (version / MODEL_YAML).write_text(
        render_template(ENGINE_MODEL, text, template_values(cfg)), encoding="utf-8"
    )


def render_model_repository(
    cfg: BuildConfig, engine_dir: Path, out_dir: Path, templates: Path | None = None
) -> dict[str, Any]:
    """Write the model repository for `engine_dir` into `out_dir`; the facts for the stage manifest."""
    engine_dir, out_dir = Path(engine_dir).resolve(), Path(out_dir)
    templates = templates or templates_dir()
    _check_engine_dir(cfg, engine_dir)
    carries_engine = cfg.backend == "torch"
    draft = draft_engine(cfg, require_built=True) if serves_draft_model(cfg) else None
    # TensorRT-LLM's C++ backend opens gpt_model_path as given: point it at the engine stage's folder.
    configs = render_configs(cfg, templates, None if carries_engine else engine_dir, draft)
    llmapi = cfg.serving.interface == "llmapi"
    out_dir.mkdir(parents=True, exist_ok=True)
    for model, text in configs.items():
        version = out_dir / model / "1"
        version.mkdir(parents=True, exist_ok=True)
        (out_dir / model / "config.pbtxt").write_text(text, encoding="utf-8")
        if llmapi:
            _write_llmapi_model(cfg, templates, version)
            continue
        shim = _model_shim(cfg, templates, model)
        if shim.is_file() and (model != "tensorrt_llm" or carries_engine):
            shutil.copyfile(shim, version / "model.py")  # a copy: the stub writes __pycache__ beside it
    if carries_engine:
        link_tree(engine_dir, out_dir / "tensorrt_llm" / "1" / ENGINE_SUBDIR)
        # The engine stage's checksums travel with it: the server verifies the weights before loading.
        if (engine_dir / MANIFEST_NAME).is_file():
            shutil.copyfile(
                engine_dir / MANIFEST_NAME, out_dir / "tensorrt_llm" / "1" / ENGINE_SUBDIR / MANIFEST_NAME
            )
    tokenizer_models = _tokenizer_models(cfg)
    for model in tokenizer_models:
        link_tree(engine_dir / TOKENIZER_SUBDIR, out_dir / model / "1" / TOKENIZER_SUBDIR)
    facts: dict[str, Any] = {
        "models": list(configs),
        "interface": cfg.serving.interface,
        "ensemble": None if llmapi else cfg.serving.ensemble,
        "backend": cfg.backend,
        "triton_backend": "python" if carries_engine else "tensorrtllm",
        "decoupled": cfg.serving.decoupled,
        # llmapi: upstream's model.yaml value (Triton hands over one request at a time)
        "triton_max_batch_size": 0 if llmapi else int(template_values(cfg)["triton_max_batch_size"]),
        "engine": f"tensorrt_llm/1/{ENGINE_SUBDIR}" if carries_engine else str(engine_dir),
        "tokenizer": (
            {ENGINE_MODEL: f"{ENGINE_MODEL}/1/{ENGINE_SUBDIR}/{TOKENIZER_SUBDIR}"}
            if llmapi
            else {m: f"{m}/1/{TOKENIZER_SUBDIR}" for m in tokenizer_models}
        ),
        "config_sha256": {m: hashlib.sha256(t.encode()).hexdigest() for m, t in configs.items()},
        "tool_packages": ["tritonclient"],
    }
    if draft is not None:
        facts["draft_engine"] = str(draft.engine_dir)
    return facts
