"""OpenVINO GenAI: the HF checkpoint exported with optimum-intel (`optimum-cli export openvino`), run by
`openvino_genai.ContinuousBatchingPipeline`, OpenVINO's own continuous batching, on the CPU.

Its stack lives in a venv of its own (`make bench-deps`: optimum-intel 2.2 pins transformers < 5.6, older
than llmpipe's), so this module runs only in a worker on that venv's python (pipeline.bench.isolation)
and imports nothing of llmpipe's beyond the pure bench modules.

Precisions: fp32 and bf16 share one fp32 export and differ in the CPU plugin's inference precision (on a
CPU with bf16 instructions OpenVINO picks bf16 unless told f32); int8 / int4 are optimum-intel's
weight-only compressions (NNCF), computed in f32 like llmpipe's weight-only modes. The KV cache is held at
the inference precision, not OpenVINO's compressed default, so each precision matches llmpipe's.
Outputs are greedy and forced to their length with min_new_tokens = max_new_tokens.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.bench.isolation import PeerJob
from pipeline.bench.load import OnRecord, RunResult
from pipeline.bench.metrics import RequestRecord
from pipeline.bench.peers import batch_result, source_identity
from pipeline.bench.requests import BenchRequest
from pipeline.errors import BackendUnavailableError

# precision -> (`optimum-cli export openvino` weight options, CPU inference precision)
PRECISIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "fp32": (("--weight-format", "fp32"), "f32"),
    "bf16": (("--weight-format", "fp32"), "bf16"),
    "int8": (("--weight-format", "int8"), "f32"),
    # NNCF's int4 groups are 128 wide: a layer whose width is no multiple of it (SmolLM2's 576) gets a
    # group size that fits instead of failing the export
    "int4": (("--weight-format", "int4", "--group-size-fallback", "adjust"), "f32"),
}
KV_CACHE_GB = 2  # room for 16 requests of a few hundred tokens at fp32, with margin


def export(hf_dir: Path, out_dir: Path, weight_options: Sequence[str]) -> Path:
    """The OpenVINO IR (model and tokenizers) of `hf_dir`, reused when present."""
    if (out_dir / "openvino_model.xml").is_file():
        return out_dir
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    cli = Path(sys.executable).with_name("optimum-cli")
    options = ("--task", "text-generation-with-past", *weight_options)
    print(f"exporting {hf_dir} to OpenVINO ({' '.join(weight_options)}) ...", file=sys.stderr)
    subprocess.run([str(cli), "export", "openvino", "--model", str(hf_dir), *options, str(tmp)], check=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.replace(out_dir)
    return out_dir


def load(job: PeerJob) -> OpenVINOPeer:
    """The worker's loader: export on first use (cached under the job's cache_dir, keyed by the
    checkpoint's identity), then load the pipeline."""
    o = job.options
    weight_options, inference = PRECISIONS[job.precision]
    _require_inference_precision(inference)
    hf_dir = Path(o["hf_dir"])
    key = source_identity(*sorted(hf_dir.glob("*.safetensors")))
    name = "-".join([f"openvino-{key}", *(option.removeprefix("--") for option in weight_options)])
    model_dir = export(hf_dir, Path(o["cache_dir"]) / name, weight_options)
    return OpenVINOPeer(model_dir, job.precision, o["max_batch_size"], o.get("threads"))


def _require_inference_precision(inference: str) -> None:
    """OpenVINO's CPU plugin computes in bf16 only where the CPU has bf16 instructions (AVX512_BF16, AMX);
    elsewhere it falls back to f32 and refuses the bf16 KV cache, so there is no bf16 run to measure."""
    if inference != "bf16":
        return
    import openvino

    capabilities = openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    if "BF16" not in capabilities:
        raise BackendUnavailableError(
            f"OpenVINO has no bf16 inference on this CPU (its CPU plugin offers {', '.join(capabilities)})",
            hint="bf16 needs AVX512_BF16 or AMX; OpenVINO's fp32, int8 and int4 runs measure on any x86-64 CPU",
        )


class OpenVINOPeer:
    system = "openvino"

    def __init__(
        self, model_dir: Path, precision: str, max_batch_size: int, num_threads: int | None = None
    ) -> None:
        import openvino_genai

        _, inference = PRECISIONS[precision]
        self.name = f"openvino-{precision}"
        self.precision = precision
        scheduler = openvino_genai.SchedulerConfig()
        scheduler.cache_size = KV_CACHE_GB
        scheduler.max_num_seqs = max_batch_size
        properties: dict[str, Any] = {"INFERENCE_PRECISION_HINT": inference, "KV_CACHE_PRECISION": inference}
        if num_threads:
            properties["INFERENCE_NUM_THREADS"] = num_threads
        self.pipe = openvino_genai.ContinuousBatchingPipeline(str(model_dir), scheduler, "CPU", properties)
        self._next_id = 0

    def run(
        self, requests: Sequence[BenchRequest], batch_size: int, on_record: OnRecord | None = None
    ) -> RunResult:
        """Closed loop: `batch_size` requests in flight, the next one added as soon as one finishes."""
        pending = list(requests)
        active: dict[int, tuple[Any, RequestRecord]] = {}
        records: list[RequestRecord] = []
        while pending or active:
            while pending and len(active) < batch_size:
                request = pending.pop(0)
                active[self._next_id] = (self._add(request), _record(request))
                self._next_id += 1
            self.pipe.step()
            now = time.perf_counter()
            for request_id, (handle, record) in list(active.items()):
                _read(handle, record, now)
                if not self._running(handle):
                    record.end = now
                    if record.num_output_tokens != record.num_expected_tokens:
                        record.error = f"openvino stopped after {record.num_output_tokens} tokens"
                    records.append(record)
                    del active[request_id]
                    if on_record is not None:
                        on_record(record)
        records.sort(key=lambda r: r.start)
        return batch_result(self, batch_size, records, mode="closed")

    def _add(self, request: BenchRequest) -> Any:
        import numpy as np
        import openvino
        import openvino_genai

        config = openvino_genai.GenerationConfig()
        config.max_new_tokens = request.output_tokens
        config.min_new_tokens = request.output_tokens
        config.do_sample = False
        ids = openvino.Tensor(np.array([request.input_ids or ()], dtype=np.int64))
        return self.pipe.add_request(self._next_id, ids, config)

    @staticmethod
    def _running(handle: Any) -> bool:
        import openvino_genai

        return bool(handle.get_status() == openvino_genai.GenerationStatus.RUNNING)

    def close(self) -> None:
        del self.pipe


def _record(request: BenchRequest) -> RequestRecord:
    start = time.perf_counter()
    return RequestRecord(
        index=request.index,
        num_input_tokens=request.num_input_tokens,
        start=start,
        end=start,
        num_expected_tokens=request.output_tokens,
    )


def _read(handle: Any, record: RequestRecord, now: float) -> None:
    """The tokens this step produced for one request (one sequence: greedy)."""
    count = 0
    while handle.can_read():
        count += sum(len(output.generated_ids) for output in handle.read().values())
    if count:
        record.response_times.append(now)
        record.response_tokens.append(count)
