"""What the runtime would build wrong is refused before any conversion, in one line that names it: a
checkpoint relabelled as another architecture (Granite's multipliers, SmolLM3's NoPE layers under Llama), an
unsupported RoPE type, quantization the torch backend cannot apply to the model, LongRoPE past its short
factors; and the configs the runtime does read come out as transformers reads them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from pipeline.architectures import SUPPORTED_ARCHITECTURES
from pipeline.architectures.hf_config import check_hf_config, pretrained_config_from_hf
from pipeline.cli.main import cli
from pipeline.errors import UnsupportedModelError
from pipeline.sources.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for arch in ("granite", "smollm3", "qwen3-moe", "phi3", "olmo2", "gemma3"):
        out[arch] = tmp_path_factory.mktemp(arch)
        make_tiny_checkpoint(out[arch], arch=arch)
    return out


def relabelled(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **changes}))
    return dst


def write_config(tmp_path: Path, source: Path, **sections: Any) -> Path:
    data = {
        "name": "t",
        "source": {"kind": "local", "path": str(source)},
        "engine": {"max_seq_len": 512, "max_input_len": 256, "max_num_tokens": 256},
        "workdir": str(tmp_path / "work"),
    }
    data.update(sections)
    path = tmp_path / "build.yaml"
    path.write_text(json.dumps(data))
    return path


def fetch(tmp_path: Path, config: Path) -> Any:
    return CliRunner().invoke(cli, ["fetch", str(config)])


@pytest.mark.parametrize(
    ("arch", "keys"),
    [
        ("granite", "embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=2.0, attention_multiplier=0.2"),
        ("smollm3", "no_rope_layers=[1, 0]"),
    ],
)  # fmt: skip
def test_a_relabelled_checkpoint_is_refused_at_fetch(
    tiny_dirs: dict[str, Path], tmp_path: Path, arch: str, keys: str
) -> None:
    source = relabelled(
        tiny_dirs[arch], tmp_path / "ckpt", architectures=["LlamaForCausalLM"], model_type="llama"
    )
    result = fetch(tmp_path, write_config(tmp_path, source))
    assert result.exit_code == 1, result.output
    assert f"LlamaForCausalLM config.json sets {keys}, which LlamaForCausalLM does not read" in result.output
    assert "Traceback" not in result.output


def test_an_unsupported_rope_type_is_refused_at_fetch(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    source = relabelled(
        tiny_dirs["granite"], tmp_path / "ckpt", rope_parameters={"rope_type": "dynamic", "factor": 2.0}
    )
    result = fetch(tmp_path, write_config(tmp_path, source))
    assert result.exit_code == 1
    assert (
        "RoPE type 'dynamic' is not implemented by the torch runtime; supported: default, linear"
        in result.output
    )


@pytest.mark.parametrize(
    ("arch", "quantization", "message"),
    [
        ("qwen3-moe", {"mode": "int8_wo"}, "quantization.mode=int8_wo: the torch backend keeps MoE experts dense"),
        ("olmo2", {"mode": "int4_awq"}, "Olmo2ForCausalLM gets round-to-nearest int8_wo / int4_wo"),
        ("gemma3", {"mode": "int4_gptq"}, "Gemma3ForCausalLM gets round-to-nearest int8_wo / int4_wo"),
    ],
)  # fmt: skip
def test_quantization_the_torch_backend_cannot_apply_is_refused_at_fetch(
    tiny_dirs: dict[str, Path], tmp_path: Path, arch: str, quantization: dict[str, Any], message: str
) -> None:
    result = fetch(tmp_path, write_config(tmp_path, tiny_dirs[arch], quantization=quantization))
    assert result.exit_code == 1, result.output
    assert message in result.output
    assert not list((tmp_path / "work").glob("*/checkpoint"))


def test_longrope_beyond_its_original_context_is_refused_at_convert(
    tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    config = write_config(
        tmp_path,
        tiny_dirs["phi3"],
        engine={"max_seq_len": 2048, "max_input_len": 1024, "max_num_tokens": 1024},
    )
    result = CliRunner().invoke(cli, ["build", str(config), "--until", "convert"])
    assert result.exit_code == 1, result.output
    assert "original_max_position_embeddings=1024" in result.output and "max_seq_len <= 1024" in result.output


def test_an_unknown_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModelError) as err:
        check_hf_config({"architectures": ["GPTNeoXForCausalLM"]})
    assert str(err.value).endswith(", ".join(SUPPORTED_ARCHITECTURES))


def test_configs_read_as_transformers_reads_them(tiny_dirs: dict[str, Path]) -> None:
    """Derived values come from transformers' own config classes: Qwen3-MoE's sparse/dense layer choice,
    Gemma 3's per-layer-type RoPE, Phi's partial rotary, SmolLM3's NoPE layers."""
    read = {
        arch: pretrained_config_from_hf(json.loads((path / "config.json").read_text()), "float32")
        for arch, path in tiny_dirs.items()
    }
    assert read["qwen3-moe"]["dense_layers"] == [1] and read["qwen3-moe"]["normalize_top_k"] is False
    assert read["gemma3"]["local_rotary_base"] == 10000.0 and read["gemma3"]["rotary_base"] == 1000000.0
    assert read["gemma3"]["rotary_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert read["gemma3"]["layer_types"] == ["sliding_attention", "full_attention"]
    assert read["phi3"]["rotary_dim"] == 8 and read["phi3"]["rotary_scaling"]["rope_type"] == "longrope"
    assert read["smollm3"]["nope_layers"] == [1]
    assert read["olmo2"]["norm_layout"] == "post" and read["olmo2"]["qk_norm"] == "full"
    assert read["granite"]["attention_scale"] == 0.2 and read["granite"]["logits_scaling"] == 2.0


def test_a_hub_checkpoint_is_refused_from_its_config_before_the_weights_download(
    tiny_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pipeline.sources.hub as hub

    source = relabelled(tiny_dirs["granite"], tmp_path / "ckpt", architectures=["LlamaForCausalLM"])
    requested: list[list[str]] = []

    def fake_snapshot_download(repo_id: str, *, allow_patterns: list[str], **_: Any) -> str:
        requested.append(allow_patterns)
        return str(source)

    monkeypatch.setattr(hub, "snapshot_download", fake_snapshot_download)
    config = write_config(tmp_path, source)
    data = json.loads(config.read_text())
    config.write_text(
        json.dumps({**data, "source": {"kind": "hub", "repo_id": "org/granite", "revision": "main"}})
    )
    result = fetch(tmp_path, config)
    assert result.exit_code == 1, result.output
    assert "LlamaForCausalLM config.json sets embedding_multiplier=3.0" in result.output
    assert requested == [["config.json"]], "only config.json may be requested before the check"
