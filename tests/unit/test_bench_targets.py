"""The speed targets of our benchmark scripts (benchmarks/harness, not shipped): the checker marks each one
met, missed or not measured from a run's measurements; rows and tables name the goal."""

from __future__ import annotations

import pytest

from benchmarks.harness.targets import ENGINE_TARGETS, PEER_TARGETS, bandwidth_verdicts, check, table


def test_targets_checker_marks_met_missed_and_not_measured() -> None:
    measured = {
        "llmpipe.fp32.single_decode_tok_s": 40.0,
        "llamacpp.f32.single_decode_tok_s": 30.0,
        "openvino.fp32.single_decode_tok_s": 32.0,  # the best fp32 peer: 40/32 = 1.25 >= 1.2: met
        "hf.fp32.single_decode_tok_s": 25.0,  # 40/25 = 1.6 < 2: missed
        "machine.fp32.decode_limit_tok_s": 80.0,  # 40/80 = 0.5 < 0.6: missed
        "llmpipe.fp32.inprocess.c16_tok_s": 320.0,
        "llmpipe.fp32.inprocess.logprobs.c16_tok_s": 300.0,  # log-probs cost the engine: not the served equal
        "llmpipe.fp32.triton.c16_tok_s": 290.0,  # 290/320 = 0.906 >= 0.9: met
        "llmpipe.int8.triton.c16_tok_s": 350.0,  # the best of ours is used
        "hf.fp32.c16_tok_s": 100.0,
        "llamacpp.q8_0.c16_tok_s": 200.0,  # the best peer is used: 350/200 = 1.75
        "ct2.float32.c16_tok_s": 190.0,
        "openvino.int8.single_decode_tok_s": 50.0,
        "llmpipe.int8.single_decode_tok_s": 55.0,  # 1.1 < 1.2: missed
        "llmpipe.fp32.ttft_p95_c16_prompt256_s": 2.0,
        "llmpipe.fp32.ttft_mean_c1_prompt256_s": 0.5,  # 4x > 3x: missed (a "<=" target)
    }
    verdicts = {v.target.comparison.key: v for v in check(PEER_TARGETS, measured)}
    fp32_single = verdicts["fp32_single_vs_best_peer"]
    assert (fp32_single.status, fp32_single.measured.denominator_key) == (
        "met",
        "openvino.fp32.single_decode_tok_s",
    )
    assert fp32_single.measured.value == pytest.approx(1.25)
    assert verdicts["int8_single_vs_best_peer"].status == "missed"
    assert verdicts["fp32_c16_vs_best_peer"].measured.value == pytest.approx(320 / 190)
    served = verdicts["fp32_served_vs_inprocess_c16"]
    assert (served.status, served.measured.denominator_key) == ("met", "llmpipe.fp32.inprocess.c16_tok_s")
    assert served.measured.value == pytest.approx(290 / 320)
    limit = verdicts["fp32_single_vs_bandwidth_limit"]
    assert (limit.status, limit.measured.value, limit.row()["goal"]) == ("missed", 0.5, ">= 0.6x")
    assert verdicts["single_vs_hf"].status == "missed"
    assert verdicts["single_vs_hf"].measured.value == pytest.approx(1.6)
    best_peer = verdicts["served_c16_vs_best_peer"]
    assert (best_peer.status, best_peer.measured.numerator_key, best_peer.measured.denominator_key) == (
        "met",
        "llmpipe.int8.triton.c16_tok_s",
        "llamacpp.q8_0.c16_tok_s",
    )
    assert verdicts["served_c16_vs_hf_static"].measured.value == pytest.approx(3.5)
    assert verdicts["ttft_p95_c16_vs_single"].status == "missed"
    not_measured = verdicts["int4_single_vs_best_peer"]
    assert not_measured.status == "not measured" and not_measured.measured.value is None
    assert "llmpipe.int4.single_decode_tok_s" in not_measured.measured.missing
    assert verdicts["bf16_served_vs_inprocess_c16"].status == "not measured"
    assert bandwidth_verdicts(list(verdicts.values())) == {
        "fp32": "llmpipe 40.0 tok/s = 50% of it (target >= 60%): missed"
    }


def test_every_precision_has_its_four_targets() -> None:
    keys = [t.comparison.key for t in PEER_TARGETS]
    for precision in ("fp32", "bf16", "int8", "w8a8", "int4"):
        for goal in (
            "single_vs_best_peer",
            "c16_vs_best_peer",
            "served_vs_inprocess_c16",
            "single_vs_bandwidth_limit",
        ):
            assert f"{precision}_{goal}" in keys


def test_target_rows_and_table_name_the_goal_and_the_status() -> None:
    measured = {"engine.fp32.output_tok_s": 300.0, "hf.fp32.static_batch.output_tok_s": 120.0}
    verdicts = check(ENGINE_TARGETS, measured)
    row = verdicts[0].row()
    assert row["target"] == "engine_vs_hf_static_batch" and row["goal"] == ">= 3x"
    assert (row["measured"], row["status"]) == (2.5, "missed")
    assert [v.status for v in verdicts[1:]] == ["not measured", "not measured"]
    text = table(verdicts)
    assert "engine output tok/s vs HF padded static batch" in text and "missed" in text
    assert "| target | goal |" in table(verdicts, markdown=True)
