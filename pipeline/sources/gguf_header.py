"""Read a GGUF file's header (metadata + tensor table) in milliseconds and refuse, before transformers
touches the file, what the GGUF -> HF conversion cannot turn into a model llmpipe builds.

Why not `gguf.GGUFReader`: it turns every metadata array element into a numpy field, so a 262k-token
vocabulary (Gemma 3) takes ~16 s and SmolLM2's 49k vocabulary ~11 s. This reader walks the same layout
with `struct` over an mmap, keeps scalars and short arrays, and only counts long arrays. The `gguf`
package still supplies the format constants (value types, quantization types and their block sizes).

Checks, in order (each refusal is one line):
1. the file is a GGUF (magic, version 2/3) whose header and tensor data fit in the file;
2. `general.architecture` is one transformers' GGUF loader can build as a causal LM, and the class it builds
   is in SUPPORTED_ARCHITECTURES;
3. every tensor's type is one `gguf.quants.dequantize` handles;
4. the tensor names are exactly the ones transformers maps onto that class (nothing it would silently drop,
   e.g. Mixtral's experts in a `llama` GGUF or Llama 3.1's `rope_freqs`; nothing it would leave at random
   init), in `block_count` blocks;
5. no metadata that changes the math and that transformers ignores (`<arch>.rope.scaling.*`).
"""

from __future__ import annotations

import importlib.metadata
import mmap
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from pipeline.architectures import SUPPORTED_ARCHITECTURES
from pipeline.errors import IntegrityError, UnsupportedModelError

# Arrays longer than this (vocabularies, merges, scores) are only counted, not read.
MAX_ARRAY_KEPT = 64

# GGUF `general.architecture` -> the class transformers' GGUF loader builds with AutoModelForCausalLM, or
# why it builds none. Mirrors transformers 5.24: integrations/ggml.py GGUF_CONFIG_MAPPING (which
# architectures it reads), modeling_gguf_pytorch_utils.load_gguf_checkpoint (renames: qwen2moe ->
# qwen2_moe, gemma3 -> gemma3_text, ...) and MODEL_FOR_CAUSAL_LM_MAPPING_NAMES. A unit test compares it with
# the installed transformers.
TRANSFORMERS_GGUF_CLASSES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "falcon": "FalconForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "bloom": "BloomForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "starcoder2": "Starcoder2ForCausalLM",
    "mamba": "MambaForCausalLM",
    "nemotron": "NemotronForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "minimax-m2": "MiniMaxM2ForCausalLM",
}
# Architectures transformers' GGUF loader reads but cannot build as a causal LM.
TRANSFORMERS_GGUF_NOT_CAUSAL: dict[str, str] = {
    "t5": "a T5 encoder-decoder, not a causal LM",
    "t5encoder": "a T5 encoder, not a causal LM",
    "umt5": "a UMT5 encoder-decoder, not a causal LM",
    "deci": "transformers has no built-in class for it (Nemotron-NAS needs trust_remote_code)",
}

# The GGUF tensor names transformers maps onto each class we accept (see get_gguf_hf_weights_map), per
# block (`blk.N.<name>`) and outside blocks. `output.weight` is optional (see UNTIED_HEAD_ARCHITECTURES):
# without it the head is tied.
_ATTN = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")
_MLP = ("ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
_QK_NORM = ("attn_q_norm.weight", "attn_k_norm.weight")
_GEMMA = (*_ATTN, *_MLP, "post_attention_norm.weight", "post_ffw_norm.weight")
BLOCK_TENSORS: dict[str, frozenset[str]] = {
    "llama": frozenset((*_ATTN, *_MLP)),
    "qwen2": frozenset((*_ATTN, *_MLP, "attn_q.bias", "attn_k.bias", "attn_v.bias")),
    "qwen3": frozenset((*_ATTN, *_MLP, *_QK_NORM)),
    "qwen3moe": frozenset(
        (
            *_ATTN,
            *_QK_NORM,
            "ffn_norm.weight",
            "ffn_gate_inp.weight",
            "ffn_gate_exps.weight",
            "ffn_up_exps.weight",
            "ffn_down_exps.weight",
        )
    ),
    "gemma2": frozenset(_GEMMA),
    "gemma3": frozenset((*_GEMMA, *_QK_NORM)),
    "phi3": frozenset(
        (
            "attn_norm.weight",
            "attn_qkv.weight",
            "attn_output.weight",
            "ffn_norm.weight",
            "ffn_up.weight",
            "ffn_down.weight",
        )
    ),
}
GLOBAL_TENSORS = frozenset(("token_embd.weight", "output_norm.weight"))
# Architectures whose untied head (`output.weight`) transformers maps; gguf-py names no GEMMA2 output tensor,
# so a gemma2 GGUF with one would get a randomly initialized lm_head.
UNTIED_HEAD_ARCHITECTURES = frozenset(("llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "phi3"))
# Tensors transformers drops whose loss changes the model's math, named in the refusal.
_DROPPED_MEANING = {
    "rope_freqs.weight": "RoPE frequency factors (Llama 3.1-style rope scaling)",
    "rope_factors_long.weight": "LongRoPE factors",
    "rope_factors_short.weight": "LongRoPE factors",
}


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array too long to keep: its element type and length."""

    element_type: int
    count: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    type_id: int
    offset: int  # from the start of the data section
    nbytes: int | None  # None for a type id gguf does not know

    @property
    def type_name(self) -> str:
        return _type_name(self.type_id)


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]
    data_offset: int
    file_size: int

    @property
    def architecture(self) -> str:
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else ""

    def tensor_types(self) -> dict[str, int]:
        """Tensor count per type name, most common first."""
        return dict(Counter(t.type_name for t in self.tensors).most_common())


@dataclass(frozen=True)
class GGUFCheck:
    """A GGUF that passed `check_gguf`: its header and the HF class transformers will build from it."""

    header: GGUFHeader
    hf_architecture: str


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse the metadata and tensor table of the GGUF at `path` (tensor data is not read)."""
    path = Path(path)
    with path.open("rb") as file:
        size = path.stat().st_size
        if size < 24:
            raise UnsupportedModelError(f"{path.name} is not a GGUF file ({size} bytes)")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _Parser(buf, path, size).header()


def supported_gguf_architectures() -> dict[str, str]:
    """GGUF architectures this pipeline converts -> the HF class each becomes."""
    return {
        arch: cls
        for arch, cls in sorted(TRANSFORMERS_GGUF_CLASSES.items())
        if cls in SUPPORTED_ARCHITECTURES and arch in BLOCK_TENSORS
    }


def transformers_gguf_class(header: GGUFHeader) -> str:
    """The HF class transformers' GGUF loader builds from this header; UnsupportedModelError if none."""
    arch, name = header.architecture, header.path.name
    if not arch:
        raise UnsupportedModelError(f"{name} has no general.architecture in its GGUF metadata")
    if arch in TRANSFORMERS_GGUF_NOT_CAUSAL:
        raise UnsupportedModelError(
            f"{name} holds a GGUF architecture {arch!r} that transformers cannot dequantize into a causal LM "
            f"({TRANSFORMERS_GGUF_NOT_CAUSAL[arch]}); {_supported_line()}"
        )
    if arch not in TRANSFORMERS_GGUF_CLASSES:
        raise UnsupportedModelError(
            f"{name} holds a GGUF architecture {arch!r} that transformers cannot dequantize (its GGUF loader "
            f"reads {', '.join(sorted(TRANSFORMERS_GGUF_CLASSES))}); {_supported_line()}",
            hint=_OTHER_SOURCES_HINT,
        )
    # transformers loads a `llama` GGUF named exactly "mistral" as MistralForCausalLM.
    if arch == "llama" and header.metadata.get("general.name") == "mistral":
        arch = "mistral"
    cls = TRANSFORMERS_GGUF_CLASSES[arch]
    if arch not in gguf.MODEL_ARCH_NAMES.values():
        raise UnsupportedModelError(
            f"{name}: transformers would build {cls} from this GGUF but cannot map its tensors: gguf "
            f"{_gguf_version()} has no tensor names for {arch!r}; {_supported_line()}"
        )
    return cls


def check_gguf(path: Path) -> GGUFCheck:
    """Refuse, from the header alone, a GGUF the GGUF -> HF conversion cannot turn into a supported model."""
    header = read_gguf_header(path)
    name, arch = header.path.name, header.architecture
    cls = transformers_gguf_class(header)
    if cls not in SUPPORTED_ARCHITECTURES or arch not in BLOCK_TENSORS:
        raise UnsupportedModelError(
            f"{name} holds a GGUF architecture {arch!r}, which transformers loads as {cls}: "
            f"not built by llmpipe; {_supported_line()}",
            hint=_OTHER_SOURCES_HINT,
        )
    _check_tensor_types(header)
    _check_layout(header, arch)
    _check_metadata(header, arch)
    return GGUFCheck(header=header, hf_architecture=cls)


_OTHER_SOURCES_HINT = (
    "an architecture without a GGUF path through transformers can still come from its HF checkpoint "
    "(`source.kind: hub` or `local`)"
)


def _supported_line() -> str:
    pairs = ", ".join(f"{arch} ({cls})" for arch, cls in supported_gguf_architectures().items())
    return f"supported GGUF architectures: {pairs}"


def dequantizable_types() -> frozenset[int]:
    """Tensor type ids `gguf.quants.dequantize` handles (F32 and F16 directly, the rest by type traits)."""
    traits = getattr(gguf.quants, "_type_traits", {})
    return frozenset({gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, *traits})


def _check_tensor_types(header: GGUFHeader) -> None:
    ok = dequantizable_types()
    bad = Counter(t.type_name for t in header.tensors if t.type_id not in ok)
    if bad:
        found = ", ".join(f"{kind} x{n}" for kind, n in bad.most_common())
        handled = ", ".join(sorted(_type_name(t) for t in ok))
        raise UnsupportedModelError(
            f"{header.path.name} has tensors of types gguf's dequantizer does not handle ({found}); "
            f"it handles {handled}"
        )


def _check_layout(header: GGUFHeader, arch: str) -> None:
    name = header.path.name
    block_names = BLOCK_TENSORS[arch]
    blocks: dict[int, set[str]] = {}
    extra: list[str] = []
    seen_globals: set[str] = set()
    for tensor in header.tensors:
        parts = tensor.name.split(".", 2)
        if parts[0] == "blk" and len(parts) == 3 and parts[1].isdigit():
            blocks.setdefault(int(parts[1]), set()).add(parts[2])
            if parts[2] not in block_names:
                extra.append(tensor.name)
        elif tensor.name in GLOBAL_TENSORS or (
            tensor.name == "output.weight" and arch in UNTIED_HEAD_ARCHITECTURES
        ):
            seen_globals.add(tensor.name)
        else:
            extra.append(tensor.name)
    if extra:
        meaning = next((_DROPPED_MEANING[t] for t in extra if t in _DROPPED_MEANING), None)
        raise UnsupportedModelError(
            f"{name} has {len(extra)} tensor(s) transformers does not map onto {arch!r} and would drop "
            f"({_first(extra)})" + (f": its {meaning} would be lost" if meaning else "")
        )
    missing = sorted(GLOBAL_TENSORS - seen_globals)
    declared = header.metadata.get(f"{arch}.block_count")
    count = declared if isinstance(declared, int) else len(blocks)
    if sorted(blocks) != list(range(count)):
        raise UnsupportedModelError(
            f"{name} declares {arch}.block_count={declared} but has tensors for blocks "
            f"{_ranges(sorted(blocks))}"
        )
    missing += [f"blk.{i}.{t}" for i in sorted(blocks) for t in sorted(block_names - blocks[i])]
    if missing:
        raise UnsupportedModelError(
            f"{name} lacks {len(missing)} tensor(s) a {arch!r} model needs ({_first(missing)}); transformers "
            "would leave them at random init"
        )


def _check_metadata(header: GGUFHeader, arch: str) -> None:
    scaling = header.metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        factor = header.metadata.get(f"{arch}.rope.scaling.factor")
        raise UnsupportedModelError(
            f"{header.path.name} uses {scaling!r} RoPE scaling (factor {factor}), which transformers' GGUF "
            f"loader ignores for {arch!r}: the dequantized model would compute different positions",
            hint="convert this model from its HF checkpoint (`source.kind: hub` or `local`)",
        )


def _gguf_version() -> str:
    try:
        return importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:
        return "(unknown version)"


def _first(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... {len(names) - limit} more" if len(names) > limit else "")


def _ranges(values: list[int]) -> str:
    if not values:
        return "none"
    runs: list[str] = []
    start = prev = values[0]
    for v in [*values[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        runs.append(f"{start}" if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(runs)


def _type_name(type_id: int) -> str:
    try:
        return gguf.GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type#{type_id}"


_SCALARS: dict[int, str] = {
    gguf.GGUFValueType.UINT8: "B",
    gguf.GGUFValueType.INT8: "b",
    gguf.GGUFValueType.UINT16: "H",
    gguf.GGUFValueType.INT16: "h",
    gguf.GGUFValueType.UINT32: "I",
    gguf.GGUFValueType.INT32: "i",
    gguf.GGUFValueType.FLOAT32: "f",
    gguf.GGUFValueType.BOOL: "?",
    gguf.GGUFValueType.UINT64: "Q",
    gguf.GGUFValueType.INT64: "q",
    gguf.GGUFValueType.FLOAT64: "d",
}
_STRING, _ARRAY = int(gguf.GGUFValueType.STRING), int(gguf.GGUFValueType.ARRAY)


class _Parser:
    def __init__(self, buf: mmap.mmap, path: Path, size: int) -> None:
        self.buf, self.path, self.size, self.pos = buf, path, size, 0
        self.endian = "<"

    def header(self) -> GGUFHeader:
        name = self.path.name
        if self.buf[:4] != b"GGUF":
            raise UnsupportedModelError(f"{name} is not a GGUF file (magic {bytes(self.buf[:4])!r})")
        version = struct.unpack_from("<I", self.buf, 4)[0]
        if version & 0xFFFF == 0:  # written big-endian
            self.endian, version = ">", struct.unpack_from(">I", self.buf, 4)[0]
        if version not in (2, 3):
            raise UnsupportedModelError(f"{name} is GGUF version {version}; only versions 2 and 3 are read")
        self.pos = 8
        try:
            n_tensors, n_kv = self._unpack("QQ")
            metadata = {}
            for _ in range(n_kv):
                key = self._string()
                metadata[key] = self._value(self._unpack("I")[0])
            infos = [self._tensor_info() for _ in range(n_tensors)]
        except (struct.error, UnicodeDecodeError, ValueError, OverflowError) as err:
            raise UnsupportedModelError(f"{name}: unreadable GGUF header ({err})") from None
        alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0:
            raise UnsupportedModelError(f"{name}: invalid general.alignment {alignment!r}")
        data_offset = -(-self.pos // alignment) * alignment
        header = GGUFHeader(
            path=self.path,
            version=version,
            metadata=metadata,
            tensors=tuple(infos),
            data_offset=data_offset,
            file_size=self.size,
        )
        ends = [data_offset + t.offset + t.nbytes for t in infos if t.nbytes is not None]
        if ends and max(ends) > self.size:
            raise IntegrityError(
                f"{name} is truncated: its tensors need {max(ends)} bytes, the file has {self.size}",
                hint="re-download or re-assemble the GGUF file",
            )
        return header

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(self.endian + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(self.endian + fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("Q")
        if self.pos + length > self.size:
            raise ValueError("string runs past the end of the file")
        text = bytes(self.buf[self.pos : self.pos + length]).decode("utf-8")
        self.pos += length
        return text

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])[0]
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        element, count = self._unpack("IQ")
        if count <= MAX_ARRAY_KEPT:
            return [self._value(element) for _ in range(count)]
        if element in _SCALARS:
            self.pos += count * struct.calcsize(_SCALARS[element])
        elif element == _STRING:
            unpack, buf, end = struct.Struct(self.endian + "Q").unpack_from, self.buf, self.size
            pos = self.pos
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
                if pos > end:
                    raise ValueError("string array runs past the end of the file")
            self.pos = pos
        else:
            for _ in range(count):
                self._value(element)
        if self.pos > self.size:
            raise ValueError("array runs past the end of the file")
        return GGUFArray(element_type=element, count=count)

    def _tensor_info(self) -> GGUFTensorInfo:
        name = self._string()
        (n_dims,) = self._unpack("I")
        shape = self._unpack("Q" * n_dims)
        type_id, offset = self._unpack("IQ")
        nbytes = None
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
            elements = 1
            for dim in shape:
                elements *= dim
            nbytes = elements // block * type_size
        except (ValueError, KeyError):
            pass
        return GGUFTensorInfo(name=name, shape=tuple(shape), type_id=type_id, offset=offset, nbytes=nbytes)
