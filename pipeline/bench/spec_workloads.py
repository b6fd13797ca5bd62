"""Workloads whose answers copy their prompts, where speculative decoding's prompt lookup pays off:

  code-edit   "edit this function" requests over short functions of llmpipe's own code, shipped as
              pipeline/data/code_edit.jsonl (the answer is mostly the function again);
  summarize   one-sentence summaries of the short articles of llmpipe's eval set (pipeline/data/eval), which
              quote names and phrases of the article.

Both are prompt text; `workloads.tokenize` turns them into ids (through the chat template when asked).
"""

from __future__ import annotations

from pipeline.bench.requests import BenchRequest
from pipeline.util.files import read_jsonl
from pipeline.util.package_data import DATA_DIR

CODE_SNIPPETS = DATA_DIR / "code_edit.jsonl"  # see code_edit.README.md beside it
EDITS = (
    "Add type hints to this Python function. Reply with the complete function only.",
    "Rename this function to `{name}_v2` and keep everything else unchanged. Reply with the code only.",
    "Add a short comment above each block of this function. Reply with the complete function.",
)
CODE_EDIT_OUTPUT_TOKENS = 256
SUMMARY_OUTPUT_TOKENS = 64


def code_snippets(count: int | None = None) -> list[tuple[str, str]]:
    """(function name, source) of the first `count` shipped snippets (all of them for None)."""
    records = [(str(r["name"]), str(r["source"])) for _, r in read_jsonl(CODE_SNIPPETS)]
    return records[:count]


def code_edit_prompt(index: int, name: str, source: str) -> str:
    return f"{EDITS[index % len(EDITS)].format(name=name)}\n```python\n{source}\n```"


def code_edit_requests(output_tokens: int = CODE_EDIT_OUTPUT_TOKENS) -> list[BenchRequest]:
    return [
        BenchRequest(index=i, output_tokens=output_tokens, prompt=code_edit_prompt(i, name, source))
        for i, (name, source) in enumerate(code_snippets())
    ]


def summarize_requests(output_tokens: int = SUMMARY_OUTPUT_TOKENS) -> list[BenchRequest]:
    from pipeline.validate.data import load_eval_set

    evals = load_eval_set("builtin")
    return [
        BenchRequest(index=i, output_tokens=output_tokens, prompt=evals.summarize_prompt(item))
        for i, item in enumerate(evals.summaries)
    ]
