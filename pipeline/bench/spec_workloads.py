"""Workloads whose answers copy their prompts, where speculative decoding's prompt lookup pays off:

  code-edit   "edit this function" requests over pure-Python standard-library functions (real code of 10-40
              lines: the answer is mostly the function again);
  summarize   one-sentence summaries of the short articles of llmpipe's eval set (pipeline/data/eval), which
              quote names and phrases of the article.

Both are prompt text; `workloads.tokenize` turns them into ids (through the chat template when asked).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from pipeline.bench.requests import BenchRequest

# (module, qualified name) of pure-Python standard-library functions to edit.
CODE_SOURCES = (
    ("textwrap", "dedent"),
    ("textwrap", "indent"),
    ("textwrap", "TextWrapper._split"),
    ("textwrap", "TextWrapper._fix_sentence_endings"),
    ("shutil", "copyfileobj"),
    ("random", "Random.shuffle"),
    ("string", "capwords"),
    ("calendar", "monthrange"),
    ("base64", "b64encode"),
    ("contextlib", "contextmanager"),
    ("argparse", "_ActionsContainer._get_positional_kwargs"),
    ("dataclasses", "_tuple_str"),
)
EDITS = (
    "Add type hints to this Python function. Reply with the complete function only.",
    "Rename this function to `{name}_v2` and keep everything else unchanged. Reply with the code only.",
    "Add a short comment above each block of this function. Reply with the complete function.",
)
CODE_EDIT_OUTPUT_TOKENS = 256
SUMMARY_OUTPUT_TOKENS = 64


def code_snippets(count: int) -> list[tuple[str, str]]:
    """(function name, source) of the first `count` CODE_SOURCES."""
    snippets = []
    for module_name, qualname in CODE_SOURCES[:count]:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        snippets.append((qualname.rsplit(".", 1)[-1], inspect.cleandoc("\n" + inspect.getsource(obj))))
    return snippets


def code_edit_prompt(index: int, name: str, source: str) -> str:
    return f"{EDITS[index % len(EDITS)].format(name=name)}\n```python\n{source}\n```"


def code_edit_requests(output_tokens: int = CODE_EDIT_OUTPUT_TOKENS) -> list[BenchRequest]:
    return [
        BenchRequest(index=i, output_tokens=output_tokens, prompt=code_edit_prompt(i, name, source))
        for i, (name, source) in enumerate(code_snippets(len(CODE_SOURCES)))
    ]


def summarize_requests(output_tokens: int = SUMMARY_OUTPUT_TOKENS) -> list[BenchRequest]:
    from pipeline.validate.data import load_eval_set

    evals = load_eval_set("builtin")
    return [
        BenchRequest(index=i, output_tokens=output_tokens, prompt=evals.summarize_prompt(item))
        for i, item in enumerate(evals.summaries)
    ]
