"""The AIPerf driver's pure parts: the command it runs, the table it lifts from AIPerf's console export,
and the summary row it reads from AIPerf's JSON export (both in AIPerf 0.13's layout)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.harness import aiperf

CONSOLE = """

                     NVIDIA AIPerf | LLM Metrics: Usage
┏━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━┓
┃                              Metric ┃    avg ┃
┡━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━┩
│ Usage Completion Tokens (tokens)    │  32.00 │
└─────────────────────────────────────┴────────┘
                     NVIDIA AIPerf | LLM Metrics
┏━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━┓
┃                              Metric ┃    avg ┃
┡━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━┩
│            Time to First Token (ms) │ 613.27 │
└─────────────────────────────────────┴────────┘

CLI Command: aiperf profile ...
"""

EXPORT = {
    "request_count": {"unit": "requests", "avg": 4.0},
    "output_token_throughput": {"unit": "tokens/sec", "avg": 9.78},
    "request_throughput": {"unit": "requests/sec", "avg": 0.31},
    "time_to_first_token": {"unit": "ms", "avg": 613.3, "p50": 701.9, "p99": 814.1},
    "inter_token_latency": {"unit": "ms", "avg": 85.3},
    "request_latency": {"unit": "ms", "avg": 3258.5},
    "input_sequence_length": {"unit": "tokens", "avg": 158.0},
    "output_sequence_length": {"unit": "tokens", "avg": 32.0},
}


def test_llm_metrics_table_is_the_unqualified_block_only() -> None:
    table = aiperf.llm_metrics_table(CONSOLE)
    assert table.splitlines()[0].strip() == "NVIDIA AIPerf | LLM Metrics"
    assert "Time to First Token (ms) │ 613.27" in table
    assert "Usage Completion" not in table
    assert table.splitlines()[-1].startswith("└") and "CLI Command" not in table


def test_llm_metrics_table_missing_is_an_error() -> None:
    with pytest.raises(ValueError, match="LLM Metrics"):
        aiperf.llm_metrics_table("no tables")


def test_summary_row_reads_aiperf_json_export() -> None:
    row = aiperf.summary_row(aiperf.Profile(8, [], "", EXPORT))
    assert (row["concurrency"], row["requests"], row["errors"]) == (8, 4, 0)
    assert (row["ttft_avg_ms"], row["ttft_p50_ms"], row["ttft_p99_ms"]) == (613.3, 701.9, 814.1)
    assert (row["isl"], row["osl"], row["output_tok_s"]) == (158.0, 32.0, 9.78)
    assert aiperf.summary_row(aiperf.Profile(1, [], "", {}))["output_tok_s"] is None


def test_command_forces_output_length_and_counts_with_the_servers_usage() -> None:
    args = aiperf.parse_args(["--input-tokens", "64", "--output-tokens", "16", "--warmup-requests", "1"])
    command = aiperf.aiperf_command(
        Path("aiperf"), "smollm2-135m", "http://127.0.0.1:9000", Path("hf"), 8, 24, args, Path("out/c8")
    )
    text = " ".join(command)
    assert command[:2] == ["aiperf", "profile"]
    assert "--endpoint-type chat --streaming" in text
    assert "--concurrency 8 --request-count 24 --warmup-request-count 1" in text
    assert "--prompt-input-tokens-mean 64" in text and "--prompt-output-tokens-mean 16" in text
    assert "--extra-inputs min_tokens:16" in text and "--use-server-token-count" in text
    assert command[-2:] == ["--output-artifact-dir", "out/c8"]


def test_errors_are_counted_from_the_error_summary() -> None:
    export = {**EXPORT, "error_summary": [{"error_details": {"code": 503}, "count": 8}, {"count": 1}]}
    assert aiperf.summary_row(aiperf.Profile(8, [], "", export))["errors"] == 9


def test_server_incidents_are_the_serve_logs_error_and_restart_lines() -> None:
    log = (
        "starting tritonserver on build/smollm2-135m/model_repo ...\n"
        "Press Ctrl-C to stop.\n"
        "error: the Python backend stub of model 'tensorrt_llm_bls' (pid 2544) died while serving; ...\n"
        "  (nothing since it became ready)\n"
        "restarting tritonserver (1/3) ...\n"
        "ready again in 14.4s\n"
    )
    assert aiperf.server_incidents(log) == [
        "error: the Python backend stub of model 'tensorrt_llm_bls' (pid 2544) died while serving; ...",
        "restarting tritonserver (1/3) ...",
    ]
    assert aiperf.server_incidents("ready in 22.6s\n") == []
