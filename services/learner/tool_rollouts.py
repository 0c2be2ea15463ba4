"""Multi-turn rollouts with a tool, token in and token out (issue 50).

An episode is a policy answering in turns. It writes; it may call the tool by writing code between `call_open` and
`call_close` (`<code>print(3 * 7)</code>`); generation stops at `call_close`, the code runs in the sandbox, and
its output, between `output_open` and `output_close`, is appended before the policy goes on. At most `max_calls`
calls and `sampling.max_tokens` tokens per episode (the policy's and the tool's together).

Token in, token out: the top bug class in peers' multi-turn RL is drift between the tokens sampled and the tokens
trained, from rendering the conversation again as text between turns (verl #3720, #3960, PR #6921). Here the ids
the engine sampled are kept as they came back, every continuation is sent as token ids (Generate's TokenPrompt),
and only the tool's output is ever tokenised. An episode is its segments in order: what the policy sampled, with
the engine's logprobs, and what the tool answered, whose tokens get loss mask 0 (they never enter the loss or an
importance ratio: `ToolEpisode.loss_mask`, `behavior_logprobs`).

Where the loop runs: here, in the learner, over rollout's Generate, not inside the rollout service. The service
stays an engine behind its contract, the tool code runs in the sandbox and never beside the weights, and a turn
costs one Generate call for all the episodes that go on (one per distinct token budget left).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from pydantic import Field

from rlep.common.config import StrictModel
from rlep.common.types import FinishReason, ToolCall, Trajectory, Verdict
from rlep.services.rollout.types import Completion, SampleOut, Sampling
from rlep.services.sandbox.config import SandboxConfig
from rlep.services.sandbox.types import ToolResult

Finish = Literal["answer", "length", "call_limit", "void"]
"""Why an episode ended: the policy answered (ended a turn without a call), the token budget ran out, it asked for
a call past `max_calls` (not run), or a void turn: it closed a call it never opened (SimpleTIR's "void turn")."""


class ToolLoopConfig(StrictModel):
    """How episodes call the tool; the markers are plain text the policy writes and reads."""

    max_calls: int = Field(4, ge=0, le=64)
    """Tool calls per episode; a turn that asks for one more ends the episode (`call_limit`)."""
    max_output_tokens: int = Field(256, ge=8)
    """Tokens of one tool output, its markers included; a longer output is cut and ends with `truncated_mark`."""
    call_open: str = Field("<code>", min_length=1)
    call_close: str = Field("</code>", min_length=1)
    call_format: Literal["code", "json"] = "code"
    """What the policy writes between the call markers. `code`: the Python to run. `json`: a function call as chat
    models are taught to write one (Hermes, Qwen2.5, SmolLM2: `{"name": "python", "arguments": {"code": "..."}}`,
    or a list holding one); a call that does not parse, names another tool or holds no code is answered with an
    error the policy reads (status `refused`), never run. Use it with `call_open: "<tool_call>"`,
    `call_close: "</tool_call>"` and `output_markers: chat_template`."""
    output_markers: Literal["text", "chat_template"] = "text"
    """`text`: the tool's output sits between `output_open` and `output_close`. `chat_template`: between what the
    policy's chat template renders around a `tool` message (`template_markers`: for ChatML, the assistant turn's end
    and `<|im_start|>tool\n`, then the tool turn's end and the next assistant header), its special tokens tokenised
    as the special ids the template means; `output_open`/`output_close` are not used."""
    output_open: str = "<output>\n"
    output_close: str = "\n</output>\n"
    truncated_mark: str = "\n[output truncated]"
    tool_workers: int = Field(4, ge=1, le=64)
    """Tool calls this loop has in flight at once (the sandbox bounds its own concurrency and each caller's too)."""


class TraceReplayConfig(StrictModel):
    """How stored tool traces are replayed (issue 50, part 3); traces come from the pool like single answers."""

    max_token_fraction: float = Field(0.25, gt=0, le=1)
    """Replayed rows' share of a step's response tokens, fresh and replayed together; rows past it are not trained
    (`replay_dropped.token_budget`), each question's first row before any question's second. In tokens, not rows:
    a trace can be many times a fresh answer's length. (The paper's 16 + 2 rows is ~0.11 of equal-length rows.)"""
    max_staleness: int | None = Field(None, ge=0)
    """Traces this run stored (online replay) at most this many weight versions older than the weights being
    trained (`trace_stale`); None: any. Another run's traces (RLEP's phase-1 pool) are replayed at any age, as
    single answers are: their versions count another run's weights."""


class ToolUseConfig(StrictModel):
    """`TrainConfig.tools`: the training step samples tool episodes instead of single answers (issue 50). An
    episode's token budget is `algorithm.max_response_tokens`; the sandbox runs in the learner's driver process
    (bubblewrap must be there: `scripts/system-deps.sh`)."""

    loop: ToolLoopConfig = ToolLoopConfig()
    sandbox: SandboxConfig = SandboxConfig()
    void_turns: Literal["filter", "penalize", "keep"] = "filter"
    """What an episode ending in a void turn (`is_void`) trains on. `filter` (SimpleTIR, arXiv 2509.02479, which
    masks such trajectories out of the loss): its reward still counts in its group's advantages, none of its tokens
    in the loss. `penalize`: trained, with its verified reward lowered by `void_penalty`. `keep`: trained as any
    other episode. The step record counts them (`tool_void_episodes`) whatever the choice."""
    void_penalty: float = Field(0.5, ge=0)
    """`penalize`: subtracted from a void episode's verified reward (math's are 1 and -1)."""
    replay: TraceReplayConfig = TraceReplayConfig()


def tool_env_hash(config: ToolUseConfig) -> str:
    """Hash of what a trace's tool outputs depend on: the loop's markers and budgets (not `tool_workers`, which only
    schedules), and the sandbox's `environment()` (isolation, limits, the interpreter). A trace replayed under
    another environment would teach calls whose outputs this one does not give."""
    env = {"loop": config.loop.model_dump(mode="json", exclude={"tool_workers"}), **config.sandbox.environment()}
    return hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()[:32]


def chat_template_hash(tokenizer: Any) -> str:
    """Hash of the chat template that renders prompts ("" text for a tokenizer without one): a trace's ids continue
    its prompt's rendering, so a trace rendered by another template is not replayed."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return hashlib.sha256(str(template).encode()).hexdigest()[:32]


def trace_environment(tokenizer: Any, config: ToolUseConfig) -> dict[str, str]:
    """The hashes a trace carries and replay checks (`Trajectory.chat_template_hash`, `tool_env_hash`), for the
    policy's tokenizer and a run's tools: the learner's fresh episodes and phase 1's collected ones alike."""
    return {"chat_template_hash": chat_template_hash(tokenizer), "tool_env_hash": tool_env_hash(config)}


def is_void(episode: ToolEpisode, verdict: Verdict) -> bool:
    """Whether an episode ends in a void turn, SimpleTIR's "neither a complete code block nor a final answer": it
    closed a call it never opened (`void`), or ended a turn without a call and without an answer the verifier could
    read (`answer` with verdict `unparseable`). An episode cut by its budget (`length`) is not void: DAPO's overlong
    shaping is the rule for those."""
    return episode.finish == "void" or (episode.finish == "answer" and verdict == Verdict.UNPARSEABLE)


@dataclass
class ToolFigures:
    """A step's tool episodes, every generation round's (kept by dynamic sampling or not), for its record."""

    episodes: int = 0
    calls: int = 0
    tool_tokens: int = 0
    response_tokens: int = 0
    finishes: Counter[str] = field(default_factory=Counter)
    void_episodes: int = 0
    """Episodes ending in a void turn (`is_void`), counted by the caller, who has their verdicts."""
    void_turns: str = "keep"
    """What was done with them (`ToolUseConfig.void_turns`)."""

    def add(self, episodes: Sequence[ToolEpisode]) -> None:
        for episode in episodes:
            mask = episode.loss_mask
            self.episodes += 1
            self.calls += len(episode.calls)
            self.tool_tokens += len(mask) - sum(mask)
            self.response_tokens += len(mask)
            self.finishes[episode.finish or "unfinished"] += 1

    def add_figures(self, other: ToolFigures) -> None:
        self.episodes += other.episodes
        self.calls += other.calls
        self.tool_tokens += other.tool_tokens
        self.response_tokens += other.response_tokens
        self.finishes.update(other.finishes)
        self.void_episodes += other.void_episodes
        self.void_turns = other.void_turns

    def record(self) -> dict[str, Any]:
        """The step record's `tool_*` fields."""
        return {
            "tool_calls_mean": self.calls / max(1, self.episodes),
            "tool_token_fraction": self.tool_tokens / max(1, self.response_tokens),
            "tool_finishes": dict(sorted(self.finishes.items())),
            "tool_void_episodes": self.void_episodes,
            "tool_void_turns": self.void_turns,
        }


@dataclass(frozen=True)
class Segment:
    source: Literal["policy", "tool"]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    """The engine's logprob of each sampled token: policy segments only."""
    policy_version: int | None = None
    """The weights that sampled a policy segment (a weight push between turns shows as two versions)."""


@dataclass
class ToolEpisode:
    prompt_token_ids: list[int]
    segments: list[Segment] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    finish: Finish | None = None
    """None while the episode goes on."""

    @property
    def response_token_ids(self) -> list[int]:
        return [token for segment in self.segments for token in segment.token_ids]

    @property
    def policy_token_ids(self) -> list[int]:
        """The policy's own tokens, every turn's, without the tool's outputs: what its answer is read from (a tool
        output that prints `\\boxed{...}` is not the policy's answer)."""
        return [token for segment in self.segments if segment.source == "policy" for token in segment.token_ids]

    @property
    def loss_mask(self) -> list[int]:
        """Per response token: 1 where the policy sampled it, 0 where the tool wrote it."""
        return [int(s.source == "policy") for s in self.segments for _ in s.token_ids]

    @property
    def behavior_logprobs(self) -> list[float]:
        """Per response token: the engine's logprob where the policy sampled it, NaN where the tool wrote it."""
        return [
            lp
            for s in self.segments
            for lp in (s.logprobs if s.logprobs is not None else [math.nan] * len(s.token_ids))
        ]

    @property
    def policy_versions(self) -> list[int]:
        return sorted({s.policy_version for s in self.segments if s.policy_version is not None})

    def to_trajectory(self, question_id: str, response_text: str, reward: float, **fields: Any) -> Trajectory:
        """The episode as a trajectory to train on: its ids, the mask, the engine's logprobs (NaN on tool tokens),
        and the oldest weights that sampled it (a push between turns: staleness counts from the first). `fields`
        go to the Trajectory (its environment's hashes; `excluded_from_loss` for a filtered void episode)."""
        return Trajectory(
            question_id=question_id,
            response_text=response_text,
            reward=reward,
            policy_version=self.policy_versions[0] if self.policy_versions else 0,
            finish_reason=FinishReason.LENGTH if self.finish == "length" else FinishReason.STOP,
            prompt_token_ids=tuple(self.prompt_token_ids),
            response_token_ids=tuple(self.response_token_ids),
            behavior_logprobs=tuple(self.behavior_logprobs),
            response_mask=tuple(self.loss_mask),
            tool_calls=tuple(self.calls),
            **fields,
        )


class Tokenizer(Protocol):
    """What the loop needs of a tokenizer (a transformers tokenizer has both)."""

    def encode(self, text: str, add_special_tokens: bool = ..., split_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


Generate = Callable[[Sequence[Sequence[int]], Sampling], list[Completion]]
"""`RolloutClient.generate` with token-id prompts."""
RunCode = Callable[[str, str], ToolResult]
"""`Sandbox.run(code, caller)`."""


def run_episodes(
    prompts: Sequence[Sequence[int]],
    sampling: Sampling,
    generate: Generate,
    run_code: RunCode,
    tokenizer: Tokenizer,
    config: ToolLoopConfig,
) -> list[list[ToolEpisode]]:
    """`sampling.n` episodes per prompt (token ids, the chat template already applied), in order, each within
    `sampling.max_tokens` tokens, the policy's and the tool's together. The first turn is one Generate call for
    every prompt; each later turn one call per distinct budget left, with n = 1 per episode and a seed of its own
    (derived from `sampling.seed`, so a seeded call is reproducible)."""
    markers = OutputMarkers(tokenizer, config)
    stop = tuple(dict.fromkeys((*sampling.stop, config.call_close)))
    budget = sampling.max_tokens
    first = generate(prompts, replace(sampling, stop=stop))
    episodes = [[ToolEpisode(list(p)) for _ in c.samples] for p, c in zip(prompts, first, strict=True)]
    turns = [(e, s) for group, c in zip(episodes, first, strict=True) for e, s in zip(group, c.samples, strict=True)]
    with ThreadPoolExecutor(config.tool_workers, thread_name_prefix="tool-call") as pool:
        for turn in range(config.max_calls + 1):  # turn t can make an episode's call t + 1 at most: bounded
            calls = [
                (e, c) for e, sample in turns if (c := _take_turn(e, sample, budget, tokenizer, config)) is not None
            ]
            callers = [f"episode-{i}" for i in range(len(calls))]
            results = list(pool.map(_answered(run_code, config), [code for _, code in calls], callers))
            for (episode, code), result in zip(calls, results, strict=True):
                _append_output(episode, code, result, budget, tokenizer, markers)
            going = [e for e, _ in calls if e.finish is None]
            if not going:
                break
            by_budget: dict[int, list[ToolEpisode]] = {}
            for episode in going:
                by_budget.setdefault(budget - len(episode.response_token_ids), []).append(episode)
            turns = []
            for left, group in sorted(by_budget.items()):
                seed = None if sampling.seed is None else _turn_seed(sampling.seed, turn, left)
                asked = replace(sampling, n=1, stop=stop, max_tokens=left, seed=seed)
                completions = generate([e.prompt_token_ids + e.response_token_ids for e in group], asked)
                turns += [(e, c.samples[0]) for e, c in zip(group, completions, strict=True)]
    return episodes


def _answered(run_code: RunCode, config: ToolLoopConfig) -> RunCode:
    """`run_code` of a call as written (`read_call`) that answers a call that does not parse, or code the sandbox
    refuses (too large, a NUL: a policy can write either), with a `refused` result the policy reads, instead of
    raising out of every episode of the call."""

    def run(call: str, caller: str) -> ToolResult:
        try:
            return run_code(read_call(call, config), caller)
        except ValueError as err:
            return ToolResult("refused", None, None, "", "", False, 0.0, "none", str(err))

    return run


def _take_turn(
    episode: ToolEpisode, sample: SampleOut, budget: int, tokenizer: Tokenizer, config: ToolLoopConfig
) -> str | None:
    """Appends the policy's turn as sampled; returns the code it asks to run, or None once the episode has ended.
    The turn is read from its own ids, decoded here: vLLM's text leaves out a stop string, its ids do not."""
    ids = tuple(sample.token_ids)
    episode.segments.append(Segment("policy", ids, tuple(sample.logprobs), sample.policy_version))
    text = tokenizer.decode(list(ids))
    close = text.find(config.call_close)
    if close < 0:
        ran_out = sample.finish_reason == FinishReason.LENGTH
        ran_out |= len(episode.response_token_ids) >= budget
        episode.finish = "length" if ran_out else "answer"
        return None
    opened = text.rfind(config.call_open, 0, close)
    if opened < 0:
        episode.finish = "void"
    elif len(episode.calls) >= config.max_calls:
        episode.finish = "call_limit"
    elif len(episode.response_token_ids) >= budget:
        episode.finish = "length"
    else:
        return text[opened + len(config.call_open) : close]
    return None


def as_text_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of `text` read as plain text: a special token's spelling in a tool's output (code that prints
    `<|endoftext|>` or `<|im_start|>assistant`) stays characters, never becomes the special id it names."""
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


# Stand-ins for a call and an output, rendered through a chat template to find what it writes around a tool message.
_CALL, _OUTPUT = "rlep-call-7f3a", "rlep-output-7f3a"


def template_markers(tokenizer: Any) -> tuple[str, str]:
    """What the tokenizer's chat template writes between an assistant turn that called a tool and the tool's output,
    and between the output and the next assistant turn (its generation prompt included): the output markers of
    `output_markers: chat_template`. ValueError for a template that renders no `tool` message."""
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": _CALL},
        {"role": "tool", "content": _OUTPUT},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as err:  # jinja's own errors (a template that raises on a role it does not know)
        raise ValueError(f"the chat template cannot render a tool message: {err}") from None
    call, output = text.find(_CALL), text.find(_OUTPUT)
    if call < 0 or output < call:
        raise ValueError("the chat template renders no tool message after an assistant turn")
    return text[call + len(_CALL) : output], text[output + len(_OUTPUT) :]


def read_call(text: str, config: ToolLoopConfig) -> str:
    """The code of a call as written between the markers (`call_format`); ValueError, answered to the policy, for a
    `json` call that is not one call of the `python` tool with a string `code` argument."""
    if config.call_format == "code":
        return text
    try:
        call = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"the tool call is not JSON: {err.msg} at {err.pos}") from None
    if isinstance(call, list) and len(call) == 1:
        call = call[0]
    arguments = call.get("arguments") if isinstance(call, dict) else None
    if isinstance(arguments, str):  # some templates write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(call, dict) or call.get("name") != "python":
        raise ValueError('the tool call must be {"name": "python", "arguments": {"code": "..."}}')
    if not isinstance(arguments, dict) or not isinstance(arguments.get("code"), str):
        raise ValueError('the python tool takes one argument, "code", a string')
    return arguments["code"]


class OutputMarkers:
    """The output markers' token ids, tokenised once; refuses a `max_output_tokens` they leave no room in. Text
    markers are plain text; a chat template's are tokenised as the template's own text is, special tokens and all."""

    def __init__(self, tokenizer: Tokenizer, config: ToolLoopConfig):
        if config.output_markers == "chat_template":
            opened, closed = template_markers(tokenizer)
            self.open = tokenizer.encode(opened, add_special_tokens=False)
            self.close = tokenizer.encode(closed, add_special_tokens=False)
        else:
            self.open = as_text_ids(tokenizer, config.output_open)
            self.close = as_text_ids(tokenizer, config.output_close)
        self.truncated = as_text_ids(tokenizer, config.truncated_mark)
        self.room = config.max_output_tokens - len(self.open) - len(self.close) - len(self.truncated)
        if self.room < 1:
            raise ValueError(
                f"tool_loop.max_output_tokens={config.max_output_tokens} leaves no room for output: its markers take "
                f"{config.max_output_tokens - self.room} tokens with this tokenizer"
            )

    def wrap(self, tokenizer: Tokenizer, text: str) -> tuple[list[int], bool]:
        """The ids the policy reads for what a tool printed: the open marker, `text` as plain text (cut to the room
        left, ending in `truncated_mark`), the close marker; and whether it was cut."""
        body = as_text_ids(tokenizer, text)
        cut = len(body) > self.room + len(self.truncated)
        if cut:
            body = body[: self.room] + self.truncated
        return self.open + body + self.close, cut


def tool_output_text(result: ToolResult) -> str:
    """What the policy reads of a call: stdout, then stderr, then why it stopped when it did not end normally."""
    text = result.stdout + result.stderr
    if result.status not in ("ok", "error"):
        text += f"\n[{result.status}: {result.detail}]" if result.detail else f"\n[{result.status}]"
    return text


def _append_output(
    episode: ToolEpisode, code: str, result: ToolResult, budget: int, tokenizer: Tokenizer, markers: OutputMarkers
) -> None:
    ids, cut = markers.wrap(tokenizer, tool_output_text(result))
    left = budget - len(episode.response_token_ids)
    if len(ids) >= left:  # the budget ends inside the output: the episode ends with the cut output
        ids, episode.finish = ids[:left], "length"
    episode.segments.append(Segment("tool", tuple(ids)))
    episode.calls.append(
        ToolCall(
            code,
            result.status,
            result.exit_code,
            result.stdout,
            result.stderr,
            result.duration_s,
            result.truncated or cut,
        )  # fmt: skip
    )


def _turn_seed(seed: int, turn: int, budget: int) -> int:
    """The seed of a later turn's call: its own stream, reproducible from the episode call's seed."""
    digest = hashlib.sha256(f"{seed}:tool-turn:{turn}:{budget}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2
