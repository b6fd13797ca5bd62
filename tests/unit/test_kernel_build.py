"""The CPU kernel library: its attention and norm ops equal the torch path and reject malformed tensors, its
cache key follows the compiler's version, and the torch backend's engine stage builds it and records it (or
fails in one line without a compiler, unless the pure-PyTorch path was chosen)."""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

import pytest
import torch

from pipeline.runtime.kernels import build
from pipeline.runtime.kernels import ops as kernels
from pipeline.runtime.model.layers import ResidualRMSNorm

needs_kernels = pytest.mark.skipif(
    not kernels.kernels_available(), reason=f"kernels unavailable: {kernels.kernels_unavailable_reason()}"
)


@needs_kernels
@pytest.mark.parametrize(("tokens", "width"), [(1, 64), (5, 61), (70, 576)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_op_equals_the_torch_path(tokens: int, width: int, with_delta: bool) -> None:
    g = torch.Generator().manual_seed(tokens * width)
    hidden, weight = torch.randn(tokens, width, generator=g), torch.rand(width, generator=g) + 0.5
    delta = torch.randn(tokens, width, generator=g) if with_delta else None
    kernel_hidden, torch_hidden = hidden.clone(), hidden.clone()
    got = ResidualRMSNorm(True, width, 1e-5)(kernel_hidden, delta, weight)
    want = ResidualRMSNorm(False, width, 1e-5)(torch_hidden, delta, weight)
    assert torch.equal(kernel_hidden, torch_hidden)  # the residual add is in place, as in torch
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@needs_kernels
def test_add_rms_norm_rejects_malformed_tensors() -> None:
    hidden, weight = torch.randn(3, 64), torch.ones(64)
    with pytest.raises(RuntimeError, match="hidden: expected a contiguous CPU Float"):
        kernels.add_rms_norm(hidden.double(), None, weight, 1e-5)
    with pytest.raises(RuntimeError, match="delta: expected .* shape \\[3, 64\\]"):
        kernels.add_rms_norm(hidden, torch.randn(3, 32), weight, 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        kernels.add_rms_norm(hidden, None, torch.ones(63), 1e-5)
    with pytest.raises(RuntimeError, match="non-contiguous"):
        kernels.add_rms_norm(torch.randn(64, 3).T, None, torch.ones(3), 1e-5)


def _attention_args(kv_dtype: torch.dtype = torch.float32, head_dim: int = 16) -> dict[str, object]:
    """A valid call: 2 sequences of 3 tokens, 4 query heads over 2 kv heads, blocks of 4."""
    rows, kv_heads = 4 * 8, 2
    cache = torch.zeros(rows, kv_heads, head_dim, dtype=kv_dtype)
    scales = torch.ones(rows, kv_heads) if kv_dtype == torch.int8 else None
    return {
        "qkv": torch.randn(6, (4 + 2 * kv_heads) * head_dim),
        "k_cache": cache,
        "v_cache": cache.clone(),
        "k_scales": scales,
        "v_scales": None if scales is None else scales.clone(),
        "cos_sin": torch.randn(32, head_dim),
        "positions": torch.tensor([0, 1, 2, 0, 1, 2]),
        "slots": torch.tensor([0, 1, 2, 4, 5, 6]),
        "block_tables": torch.tensor([[0], [1]], dtype=torch.int32),
        "token_seq": torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.int32),
        "num_heads": 4,
        "block_size": 4,
        "window": 0,
        "max_context": 3,
        "scale": 0.25,
    }


@needs_kernels
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"qkv": torch.randn(6, 128, dtype=torch.float64)}, "qkv: expected a CPU float32"),
        ({"qkv": torch.randn(6, 100)}, "qkv: expected .* shape \\[T, 128\\]"),
        (
            {"k_cache": torch.zeros(32, 2, 16, dtype=torch.float16)},
            "k_cache: expected float32, bfloat16 or int8",
        ),
        ({"v_cache": torch.zeros(32, 16, 2).transpose(1, 2)}, "v_cache: .*non-contiguous"),
        ({"k_scales": torch.ones(32, 2), "v_scales": torch.ones(32, 2)}, "for an int8 cache only"),
        ({"positions": torch.tensor([0, 1, 2, 0, 1, 2], dtype=torch.int32)}, "positions: expected"),
        ({"block_tables": torch.tensor([[0], [1]])}, "block_tables: expected"),
        ({"num_heads": 3}, "do not share"),
        ({"block_size": 5}, "not whole blocks"),
        ({"max_context": 99}, "max_context 99 is beyond"),
    ],
)
def test_paged_attention_rejects_malformed_tensors(change: dict[str, object], message: str) -> None:
    args = {**_attention_args(), **change}
    with pytest.raises(RuntimeError, match=message):
        kernels.paged_attention(**args)  # type: ignore[arg-type]


@needs_kernels
def test_paged_attention_checks_the_int8_cache_and_head_dim() -> None:
    args = {**_attention_args(torch.int8), "v_scales": None}
    with pytest.raises(RuntimeError, match="an int8 cache needs k_scales and v_scales"):
        kernels.paged_attention(**args)  # type: ignore[arg-type]
    args = {**_attention_args(torch.int8), "k_scales": torch.ones(32, 3)}
    with pytest.raises(RuntimeError, match="k_scales: expected"):
        kernels.paged_attention(**args)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 8"):
        kernels.paged_attention(**_attention_args(head_dim=12))  # type: ignore[arg-type]
    out = kernels.paged_attention(**_attention_args(torch.int8))  # type: ignore[arg-type]
    assert out.shape == (6, 64) and bool(out.isfinite().all())


def _fake_compiler(path: Path, version: str) -> str:
    """A compiler that reports `version` and compiles with the real one."""
    real = shutil.which("c++") or shutil.which("g++")
    if real is None:
        pytest.skip("no C++ compiler")
    path.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo "{version}"; exit 0; }}\nexec {real} "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_the_cache_key_follows_the_compiler_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    source = tmp_path / "answer.c"
    source.write_text("int answer(void) { return 42; }\n")
    compiler = _fake_compiler(tmp_path / "cxx", "fake c++ 12.2.0")
    assert build.compiler_identity(compiler) == "fake c++ 12.2.0"

    def compile_answer() -> Path:
        args = ["-shared", "-fPIC"]
        target = build.cache_path("answer", [source], args, compiler, build.compiler_identity(compiler), "")
        return build.compile_cached(compiler, [source], args, target)

    old = compile_answer()
    assert compile_answer() == old
    _fake_compiler(tmp_path / "cxx", "fake c++ 13.1.0")  # the same command, upgraded
    new = compile_answer()
    assert new != old and new.is_file() and old.is_file()


def test_the_library_plan_names_the_isa_compiler_and_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(build.DISABLE_ENV, raising=False)
    try:
        library = build.plan_library()
    except build.KernelsUnavailable as exc:
        pytest.skip(str(exc))
    assert library.isa == build.kernel_isa()
    assert library.compiler == build.compiler_identity(build.compiler_command())
    assert library.path.parent == build.cache_dir() and library.path.name.startswith(
        f"llmpipe_quant_{library.isa}-"
    )


@pytest.mark.parametrize(
    ("value", "disabled"), [("", False), ("0", False), ("1", True), (" 1 ", True), ("yes", None)]
)
def test_the_disable_switch_is_0_or_1(
    value: str, disabled: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(build.DISABLE_ENV, value)
    if disabled is None:
        with pytest.raises(build.KernelsUnavailable, match="expected 1") as info:
            build.kernels_disabled()
        assert not info.value.chosen
    else:
        assert build.kernels_disabled() is disabled
    if disabled:
        with pytest.raises(build.KernelsUnavailable, match="disabled by LLMPIPE_DISABLE_KERNELS=1") as info:
            build.plan_library()
        assert info.value.chosen


def test_a_runtime_build_failure_is_logged_as_an_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(build.DISABLE_ENV, raising=False)
    monkeypatch.setenv("CXX", "no-such-c++")
    with caplog.at_level("WARNING", logger=build.__name__):
        library, reason = build.load_library()
    assert library is None
    if "x86-64 Linux" in reason or "AVX2" in reason:
        pytest.skip(reason)
    assert "no C++ compiler 'no-such-c++' on PATH" in reason
    assert [r.levelname for r in caplog.records] == ["ERROR"] and reason in caplog.records[0].getMessage()
    monkeypatch.setenv(build.DISABLE_ENV, "1")  # the user's own choice is not an error
    caplog.clear()
    assert build.load_library() == (None, "disabled by LLMPIPE_DISABLE_KERNELS=1")
    assert caplog.records == []
