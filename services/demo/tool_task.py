"""The tool demo's traces (issue 50, part 4): sums of five numbers, where a calculator lifts the ceiling.

A direct answer adds step by step, four additions for five numbers (`task.worked_solution`); the tiny model's
pilot on five numbers in [1, 20] plateaued near 0.28 that way. A tool trace copies the sum into code, reads what
the sandbox printed, and boxes it:

    <code>print(3+17+5+9+12)</code>   the policy, up to the call's stop
    <output>\\n46\\n\\n</output>\\n   the tool: its tokens are never trained (loss mask 0)
     \\boxed{46}                      the policy again, then EOS

`trace_segments` writes one as the tool loop lays an episode out (`rlep.services.learner.tool_rollouts`): the
tool's part is the loop's own output text, its markers tokenised on their own as the loop does, so a warm-up row
holds the ids an episode of the same text holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from rlep.services.demo.task import Problem
from rlep.services.learner.tool_rollouts import ToolLoopConfig, as_text_ids, tool_output_text
from rlep.services.sandbox.types import ToolResult

TOOL_TERMS = 5  # numbers per question: four additions by hand, one line of code with the tool
Kind = Literal["policy", "tool"]
Segments = Sequence[tuple[Kind, str]]


def tool_trace(problem: Problem, loop: ToolLoopConfig) -> list[tuple[Kind, str]]:
    """The episode that calls the tool once on `problem` and boxes what it printed, as (kind, text) segments; the
    tool segment's text is the output open marker, what the loop shows of a clean run, and the close marker."""
    if loop.call_format != "code" or loop.output_markers != "text":
        raise ValueError("tool traces are written with code calls and text output markers (the tiny model's)")
    expression = problem.question.removesuffix("=?")
    printed = ToolResult("ok", 0, None, f"{problem.answer}\n", "", False, 0.0, "bubblewrap")
    return [
        ("policy", f"{loop.call_open}print({expression}){loop.call_close}"),
        ("tool", loop.output_open + tool_output_text(printed) + loop.output_close),
        ("policy", f" \\boxed{{{problem.answer}}}"),
    ]


def encode_segments(tokenizer, segments: Segments, loop: ToolLoopConfig | None) -> tuple[list[int], list[int]]:
    """A completion's token ids (EOS appended) and its mask (1 policy, 0 tool). Policy text is tokenised as the
    warm-up always has; a tool segment as the loop does: its open marker, body and close marker each on their own,
    as plain text."""
    ids: list[int] = []
    mask: list[int] = []
    for kind, text in segments:
        if kind == "tool":
            if loop is None or not (text.startswith(loop.output_open) and text.endswith(loop.output_close)):
                raise ValueError("a tool segment needs the loop's output markers around it")
            body = text[len(loop.output_open) : len(text) - len(loop.output_close)]
            part = [*as_text_ids(tokenizer, loop.output_open), *as_text_ids(tokenizer, body)]
            part += as_text_ids(tokenizer, loop.output_close)
        else:
            part = tokenizer.encode(text, add_special_tokens=False)
        ids += part
        mask += [int(kind == "policy")] * len(part)
    return [*ids, tokenizer.eos_token_id], [*mask, 1]
