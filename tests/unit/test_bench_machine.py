"""The machine block of the results page: ISA flags from /proc/cpuinfo, measured bandwidth and matmul
rates in a sane range, weight bytes read per decode step from a real safetensors file, the limit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pipeline.bench import machine

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile amx_int8 avx512_vnni
bugs\t\t: spectre_v1

processor\t: 1
flags\t\t: fpu sse2
"""


def test_isa_flags_reads_the_first_flags_line_in_order() -> None:
    assert machine.isa_flags(CPUINFO) == (
        "avx2",
        "fma",
        "avx512f",
        "avx512_vnni",
        "avx512_bf16",
        "amx_tile",
        "amx_bf16",
        "amx_int8",
    )
    assert machine.isa_flags("flags\t: fpu sse2 avx\n") == ()
    assert machine.isa_flags("no flags here") == ()


def test_this_machines_isa_is_a_subset_of_the_known_flags() -> None:
    assert set(machine.cpu_isa()) <= set(machine.ISA_FLAGS)


def test_read_bandwidth_is_in_a_sane_range() -> None:
    # DDR4 single channel ~10 GB/s; nothing a 2-thread sum reads from DRAM reaches 1 TB/s
    rate = machine.read_bandwidth_gb_s(2, num_bytes=64 * 1024 * 1024, repeats=2)
    assert 0.5 < rate < 1000


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gemm_rate_is_in_a_sane_range(dtype: str) -> None:
    rate = machine.gemm_gflops(dtype, 2, size=256, repeats=2)
    assert 0.1 < rate < 100_000


def test_torch_threads_are_restored() -> None:
    before = torch.get_num_threads()
    with machine.torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_weight_bytes_leave_out_the_embedding_table_when_an_lm_head_is_stored(tmp_path: Path) -> None:
    save_file(
        {
            "transformer.vocab_embedding.weight": torch.zeros(100, 8),  # 3200 bytes, one row read per step
            "lm_head.weight": torch.zeros(100, 8),  # 3200
            "transformer.layers.0.mlp.fc.weight": torch.zeros(8, 8, dtype=torch.bfloat16),  # 128
        },
        str(tmp_path / "rank0.safetensors"),
    )
    assert machine.tensor_bytes(tmp_path / "rank0.safetensors")["lm_head.weight"] == 3200
    assert machine.weight_bytes(tmp_path) == 3200 + 128


def test_tied_embeddings_stored_once_are_counted(tmp_path: Path) -> None:
    save_file({"model.embed_tokens.weight": torch.zeros(100, 8)}, str(tmp_path / "model.safetensors"))
    assert machine.weight_bytes(tmp_path) == 3200


def test_decode_limit_and_header() -> None:
    assert machine.decode_limit_tok_s(500_000_000, 20.0) == pytest.approx(40.0)
    with pytest.raises(ValueError):
        machine.decode_limit_tok_s(0, 20.0)
    facts = machine.MachineFacts(("avx2", "avx512_bf16"), 2, 20.0, {"fp32": 90.0, "bf16": 230.0})
    text = machine.header(
        facts, {"fp32": 500_000_000, "int8": 250_000_000}, {"fp32": "llmpipe 30 tok/s: met"}
    )
    assert "avx2, avx512_bf16" in text and "20.0 GB/s" in text and "bf16 230 GFLOP/s" in text
    assert "- fp32: 500 MB -> 40.0 tok/s; llmpipe 30 tok/s: met" in text
    assert text.endswith("- int8: 250 MB -> 80.0 tok/s")
    assert machine.limit_measurements(facts, {"fp32": 500_000_000}) == {
        "machine.fp32.decode_limit_tok_s": pytest.approx(40.0)
    }
    assert facts.row()["gemm_gflops"] == {"fp32": 90.0, "bf16": 230.0}
