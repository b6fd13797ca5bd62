"""The speculative-decoding benchmark (a benchmark, not a timed test): single-request decode speed
of the torch engine with and without prompt lookup (NgramProposer) on SmolLM2-135M, on three workloads:

  copy      "edit this code" prompts over Python standard-library functions: the answer mostly copies the
            prompt (where prompt lookup shines), greedy;
  chat      open-ended questions from the shipped prompt set, greedy (drafts come only from the model
            repeating itself);
  sampled   the same questions sampled at temperature 1 (seeded): drafts are mostly rejected, which is what
            adaptive draft length must keep cheap.

The two settings are two engines over the same engine directory that decode each prompt side by side,
one step each in turn, so the background load of a shared machine hits both sides of every ratio alike. Reports decode tokens/s
(output tokens after the first, over the time after the first), their ratio, the acceptance rate and the
accepted tokens per decode step, checks that every output is identical with speculation on and off, and
marks the speculation targets of benchmarks/harness/targets.py met or missed.

    python scripts/bench_spec.py                      # all workloads, 1 thread
    python scripts/bench_spec.py --workloads copy --prompts 4 --max-tokens 96   # a quick look
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# this checkout's pipeline, not an installed llmpipe, and benchmarks/harness, which is never installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.util.openmp import default_wait_policy  # noqa: E402

default_wait_policy(os.environ)  # before torch loads
from benchmarks.harness import targets  # noqa: E402
from pipeline.bench.builds import ensure_built  # noqa: E402
from pipeline.bench.report import load_1m  # noqa: E402
from pipeline.bench.spec_workloads import code_edit_prompt, code_snippets  # noqa: E402
from pipeline.bench.workloads import chat_ids, shipped_prompts  # noqa: E402
from pipeline.errors import run_script  # noqa: E402
from pipeline.runtime.core.sampling_params import SamplingParams  # noqa: E402
from pipeline.runtime.engine.engine_args import EngineArgs, RunnerArgs, SpeculationArgs  # noqa: E402
from pipeline.runtime.engine.llm_engine import LLMEngine  # noqa: E402
from pipeline.runtime.spec_decode.metrics import spec_decode_stats  # noqa: E402


@dataclass
class Case:
    workload: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class Side:
    """One setting's totals over a workload."""

    num_decode_tokens: int = 0
    decode_seconds: float = 0.0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    num_decode_steps: int = 0
    ratios: list[float] = field(default_factory=list)  # per prompt, on/off decode speed

    @property
    def tok_s(self) -> float:
        return self.num_decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", default="build_configs/smollm2-135m.yaml", help="build config of the engine"
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--workloads", default="copy,chat,sampled")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--max-draft-len", type=int, default=6)
    parser.add_argument("--min-match", type=int, default=2)
    parser.add_argument("--max-match", type=int, default=5)
    parser.add_argument("--no-adaptive", action="store_true", help="fixed draft length")
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1 suits a loaded 2-core machine)"
    )
    parser.add_argument("--kv-tokens", type=int, default=8192, help="KV cache size of each engine")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return parser.parse_args(argv)


def build_cases(tokenizer: Any, workloads: list[str], num_prompts: int, max_tokens: int) -> list[Case]:
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, end_id=tokenizer.eos_token_id)
    cases = []
    if "copy" in workloads:
        for i, (name, source) in enumerate(code_snippets(num_prompts)):
            cases.append(Case("copy", chat_ids(tokenizer, code_edit_prompt(i, name, source)), greedy))
    questions = [r.prompt or "" for r in shipped_prompts()[:num_prompts]]
    if "chat" in workloads:
        cases += [Case("chat", chat_ids(tokenizer, q), greedy) for q in questions]
    if "sampled" in workloads:
        cases += [
            Case("sampled", chat_ids(tokenizer, q), dataclasses.replace(greedy, temperature=1.0, seed=i))
            for i, q in enumerate(questions)
        ]
    return cases


def run_side_by_side(engines: dict[str, LLMEngine], case: Case, index: int) -> dict[str, tuple[Any, float]]:
    """Run the case on every engine at once, one step each in turn (alternating the order), so that load
    changes on any time scale longer than a step hit all engines alike. Per engine: (request, seconds spent
    in its steps after the first output token)."""
    requests = {
        label: e.add_request(f"{label}-{index}", case.prompt_ids, case.params) for label, e in engines.items()
    }
    seconds = dict.fromkeys(engines, 0.0)
    order = list(engines)
    while not all(r.status.finished for r in requests.values()):
        order.reverse()
        for label in order:
            request = requests[label]
            if request.status.finished:
                continue
            decoding = request.num_output_tokens > 0
            start = time.perf_counter()
            engines[label].step()
            if decoding:
                seconds[label] += time.perf_counter() - start
    return {label: (requests[label], seconds[label]) for label in engines}


def measure(engines: dict[str, LLMEngine], cases: list[Case]) -> dict[str, dict[str, Side]]:
    results: dict[str, dict[str, Side]] = {}
    for i, case in enumerate(cases):
        sides = results.setdefault(case.workload, {label: Side() for label in engines})
        runs = run_side_by_side(engines, case, i)
        if runs["off"][0].output_token_ids != runs["on"][0].output_token_ids:
            raise RuntimeError(f"{case.workload} prompt {i}: output differs with speculation on")
        speeds = {}
        for label, (request, seconds) in runs.items():
            side = sides[label]
            num_decoded = request.num_output_tokens - 1
            side.num_decode_tokens += num_decoded
            side.decode_seconds += seconds
            speeds[label] = num_decoded / seconds if seconds else 0.0
            stats = spec_decode_stats(request.stats, request.num_output_tokens)
            side.num_draft_tokens += stats.num_draft_tokens
            side.num_accepted += stats.num_accepted_draft_tokens
            side.num_decode_steps += stats.num_decode_steps
        if speeds["off"]:
            sides["on"].ratios.append(speeds["on"] / speeds["off"])
        print(
            f"[{case.workload} {i}] {runs['on'][0].num_output_tokens} tokens: off {speeds['off']:.1f} tok/s, "
            f"on {speeds['on']:.1f} tok/s",
            file=sys.stderr,
        )
    return results


COLUMNS = (
    ("workload", "workload"),
    ("prompts", "prompts"),
    ("output_tokens", "output tokens"),
    ("tok_s_off", "decode tok/s off"),
    ("tok_s_on", "decode tok/s prompt lookup"),
    ("ratio", "ratio on/off"),
    ("median_ratio", "median per-prompt ratio"),
    ("acceptance_rate", "acceptance rate"),
    ("accepted_per_step", "accepted tokens/step"),
    ("drafts_per_step", "drafts/step"),
)


def summarize(results: dict[str, dict[str, Side]]) -> list[dict[str, Any]]:
    rows = []
    for workload, sides in results.items():
        off, on = sides["off"], sides["on"]
        ratios = sorted(on.ratios)
        steps = on.num_decode_steps
        rows.append(
            {
                "workload": workload,
                "prompts": len(ratios),
                "output_tokens": off.num_decode_tokens + len(ratios),
                "tok_s_off": round(off.tok_s, 2),
                "tok_s_on": round(on.tok_s, 2),
                "ratio": round(on.tok_s / off.tok_s, 3) if off.tok_s else None,
                "median_ratio": round(ratios[len(ratios) // 2], 3) if ratios else None,
                "acceptance_rate": round(on.num_accepted / on.num_draft_tokens, 3)
                if on.num_draft_tokens
                else None,
                "accepted_per_step": round(on.num_accepted / steps, 3) if steps else None,
                "drafts_per_step": round(on.num_draft_tokens / steps, 3) if steps else None,
            }
        )
    return rows


# the workloads as `llmpipe bench --dataset` names them in its measurement keys
DATASETS = {"copy": "code-edit", "chat": "builtin"}


def measurement_keys(rows: list[dict[str, Any]], precision: str) -> dict[str, float]:
    """The rows' decode speeds under the keys of a `llmpipe bench --speculation none,ngram` run."""
    found = {}
    for row in rows:
        if row["workload"] in DATASETS:
            base = f"llmpipe.{precision}.inprocess.{DATASETS[row['workload']]}"
            found[f"{base}.none.single_decode_tok_s"] = row["tok_s_off"]
            found[f"{base}.ngram.single_decode_tok_s"] = row["tok_s_on"]
    return found


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join("-" if r[k] is None else str(r[k]) for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python scripts/bench_spec.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    build = ensure_built(args.config, args.overrides, until="engine")
    assert build.engine_dir is not None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build.hf_dir)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    cases = build_cases(tokenizer, workloads, args.prompts, args.max_tokens)
    # Two engines, each with its own KV cache (and weights): both hold a live request at once.
    runner = RunnerArgs(num_threads=args.threads, kv_max_tokens=args.kv_tokens)
    ngram = SpeculationArgs(
        mode="ngram",
        max_draft_len=args.max_draft_len,
        ngram_min_match=args.min_match,
        ngram_max_match=args.max_match,
        adaptive=not args.no_adaptive,
    )
    engines = {
        "off": LLMEngine.from_engine_dir(
            build.engine_dir, EngineArgs(runner=runner, speculation=SpeculationArgs(mode="none"))
        ),
        "on": LLMEngine.from_engine_dir(build.engine_dir, EngineArgs(runner=runner, speculation=ngram)),
    }
    run_side_by_side(engines, build_cases(tokenizer, ["chat"], 1, 8)[0], -1)  # warm-up
    load = load_1m()
    results = measure(engines, cases)
    rows = summarize(results)
    verdicts = targets.check(targets.SPECULATION_TARGETS, measurement_keys(rows, build.precision))
    print(f"\n{command}\nload avg (1 min) at start: {load}, threads: {args.threads}\n")
    print(markdown(rows))
    print()
    print(targets.table(verdicts))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {"command": command, "load_1m": load, "rows": rows, "targets": [v.row() for v in verdicts]},
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    run_script(main)
