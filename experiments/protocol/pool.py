"""Phase 1 of the protocol: collecting a pool from a checkpoint, its coverage and diversity, copying a pool; and
which machine timed a run (a collection's seconds are that machine's)."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from rlep.experiments.protocol import archive as archived
from rlep.experiments.protocol.compare import pool_diversity
from rlep.experiments.protocol.config import ProtocolConfig
from rlep.services.learner.config import TrainConfig


def machine() -> str:
    """Which CPU timed a run: step times from different machines are not comparable. The model name alone does not
    tell machines apart (two "AMD EPYC" machines here ran 2x apart), so its family, model and clock come with it."""
    cpuinfo = Path("/proc/cpuinfo")
    fields: dict[str, str] = {}
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's
    if "model name" not in fields:
        return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    mhz = float(fields.get("cpu MHz", 0))
    detail = f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}, {mhz:.0f} MHz"
    return f"{fields['model name']} ({detail}), {os.cpu_count()} cores"


def collect_pool(cfg: ProtocolConfig, stack, checkpoint: Path, pool: str, rule: str, base: TrainConfig) -> dict:
    """Phase 1 into `pool` (dropped first) from `checkpoint`; returns the collection's and the pool's figures."""
    step = checkpoint.parent.name.removeprefix("step_")
    from rlep.services.launch import collection
    from rlep.services.learner.config import CollectConfig
    from rlep.services.learner.cursor import load_questions

    done = cfg.work_dir / f"pool-{pool}.json"
    replay = stack.services.replay
    if done.exists() and pool in replay.list_pools():
        return json.loads(done.read_text())
    if pool in replay.list_pools():
        replay.drop(pool, confirm=pool)
    questions = load_questions(base.data.train_files)
    config = CollectConfig(
        samples_per_question=cfg.collect_samples,
        max_response_tokens=cfg.max_response_tokens,
        seed=cfg.seeds[0],
        run_id=f"collect-{pool}",
        keep_rule=rule,
    )
    started = time.perf_counter()
    stats = collection.collect_pool(base, checkpoint, questions, pool, config, stack)
    figures = {
        "checkpoint_step": int(step) if step.isdigit() else None,
        "rule": rule,
        "samples_per_question": cfg.collect_samples,
        "success_rate": stats.success_rate,
        "questions_kept": stats.questions_kept,
        "successes_stored": stats.successes_stored,
        "seconds": time.perf_counter() - started,
        "machine": machine(),  # a pool is collected again in each session that resumes: its seconds are that machine's
        **pool_figures(replay, pool, questions),
    }
    done.write_text(json.dumps(figures))
    if cfg.archive:
        archived.save_file(cfg.archive, f"pools/{done.name}", done)
    return figures


def pool_figures(replay, pool: str, questions) -> dict:
    """Coverage and diversity of a pool, read back from the replay service (what RLEP can actually draw)."""
    from dataclasses import asdict

    from rlep.services.demo.task import make_problem, solution_paths

    texts: dict[str, list[str]] = {}
    chunks = replay.export(pool) if pool in replay.list_pools() else []  # a collection that kept nothing made none
    for chunk in chunks:
        for t in chunk.trajectories:
            texts.setdefault(t.question_id, []).append(t.response_text)
    numbers = {q.question_id: [int(n) for n in q.messages[-1][1].removesuffix("=?").split("+")] for q in questions}

    def path_of(qid: str, text: str) -> str:
        # A success is the worked solution it equals (EOS and spaces aside); anything else counts on its own.
        paths = solution_paths(make_problem(numbers[qid]))
        return next((p for p in paths if p.replace(" ", "") == text.replace(" ", "")), "other:" + text)

    return asdict(pool_diversity(texts, list(numbers), path_of))


def copy_pool(replay, source: str, target: str, histories: bool = True) -> None:
    """Copies every question and success of `source` into `target` (online replay writes to its pool), and the
    question histories runs reported into `source` unless `histories` is False."""
    chunks = list(replay.export(source))
    for chunk in chunks:
        chunk.pool = target
        if not histories:
            del chunk.histories[:]
    replay.import_chunks(chunks)
