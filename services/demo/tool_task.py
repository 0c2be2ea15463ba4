"""The tool demo's traces (issue 50, part 4): sums of five numbers, where a calculator lifts the ceiling.

A direct answer adds step by step, four additions for five numbers (`task.worked_solution`); the tiny model's
pilot on five numbers in [1, 20] plateaued near 0.28 that way. A tool trace copies the sum into code, reads what
the sandbox printed, and boxes it:

    <code>print(3+17+5+9+12)</code>   the policy, up to the call's stop
    <output>\\n46\\n\\n</output>\\n   the tool: its tokens are never trained (loss mask 0)
     \\boxed{46}                      the policy again, then EOS

`tool_trace` writes one, and `encode_segments` lays it out as the tool loop lays out an episode
(`rlep.services.learner.tool_rollouts`): the tool's part through the loop's own `OutputMarkers.wrap`, so a warm-up
row holds the ids an episode of the same text holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from rlep.services.demo.task import Problem
from rlep.services.learner.tool_rollouts import OutputMarkers, ToolLoopConfig, tool_output_text
from rlep.services.sandbox.types import ToolResult

TOOL_TERMS = 5  # numbers per question: four additions by hand, one line of code with the tool
Kind = Literal["policy", "tool"]
Segments = Sequence[tuple[Kind, str]]


def tool_trace(problem: Problem, loop: ToolLoopConfig) -> list[tuple[Kind, str]]:
    """The episode that calls the tool once on `problem` and boxes what it printed, as (kind, text) segments; a
    tool segment's text is what the loop shows of the call (`tool_output_text` of a clean run), markers aside."""
    if loop.call_format != "code" or loop.output_markers != "text":
        raise ValueError("tool traces are written with code calls and text output markers (the tiny model's)")
    expression = problem.question.removesuffix("=?")
    printed = ToolResult("ok", 0, None, f"{problem.answer}\n", "", False, 0.0, "bubblewrap")
    return [
        ("policy", f"{loop.call_open}print({expression}){loop.call_close}"),
        ("tool", tool_output_text(printed)),
        ("policy", f" \\boxed{{{problem.answer}}}"),
    ]


def encode_segments(tokenizer, segments: Segments, loop: ToolLoopConfig | None) -> tuple[list[int], list[int]]:
    """A completion's token ids (EOS appended) and its mask (1 policy, 0 tool). Policy text is tokenised as the
    warm-up always has; a tool segment as the loop lays out an output (`OutputMarkers.wrap`: `loop`'s markers
    around the text, cut as the loop cuts it)."""
    markers = OutputMarkers(tokenizer, loop) if loop is not None else None
    ids: list[int] = []
    mask: list[int] = []
    for kind, text in segments:
        if kind == "tool":
            if markers is None:
                raise ValueError("a tool segment needs the loop's settings (its output markers)")
            part, _ = markers.wrap(tokenizer, text)
        else:
            part = tokenizer.encode(text, add_special_tokens=False)
        ids += part
        mask += [int(kind == "policy")] * len(part)
    return [*ids, tokenizer.eos_token_id], [*mask, 1]
