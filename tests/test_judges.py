"""The straggler and hang judges on samples made by hand: what they find, and what they do not."""

from __future__ import annotations

import random

from slurmrun.errors import HangError
from slurmrun.launcher.hangs import AUTO_FACTOR, AUTO_FLOOR, HangJudge
from slurmrun.launcher.stragglers import StragglerJudge
from slurmrun.stacks.report import Frame, RankStacks, StackReport, StackSource, ThreadStack
from slurmrun.stacks.sched import Sched

TRAIN = "/work/train.py"
C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def _stacks(
    rank: int,
    waiting: bool,
    line: int = 10,
    progress: int | None = None,
    sched: Sched | None = None,
) -> RankStacks:
    frames = [Frame(TRAIN, 100, "main"), Frame(TRAIN, line, "step")]
    if waiting:
        frames.append(Frame(C10D, 2810, "all_reduce"))
    thread = ThreadStack("MainThread", tuple(frames))
    return RankStacks(
        rank, f"node{rank}", 0, (thread,), StackSource.PYTHON, progress=progress, sched=sched
    )


def _sample(waiting: dict[int, bool], **kw: int | None) -> StackReport:
    return StackReport(tuple(_stacks(r, w, **kw) for r, w in waiting.items()), "sampled", 0.0)


def _samples(slow: int | None, share: float, seconds: float, ranks: int = 4) -> list[StackReport]:
    """Four samples a second: `slow` works while the others wait in `share` of them; the
    others, balanced, each are last now and then (jitter)."""
    rng = random.Random(7)
    reports = []
    for _ in range(int(seconds * 4)):
        waiting = dict.fromkeys(range(ranks), False)
        if slow is not None and rng.random() < share:
            waiting = {r: r != slow for r in range(ranks)}
        elif rng.random() < 0.3:  # balanced jitter: a random rank is last
            last = rng.randrange(ranks)
            waiting = {r: r != last for r in range(ranks)}
        reports.append(_sample(waiting))
    return reports


def test_a_rank_last_in_a_quarter_of_the_samples_is_found_once_per_window() -> None:
    judge = StragglerJudge(window=15.0)
    found = []
    for i, report in enumerate(_samples(slow=2, share=0.25, seconds=40)):
        found += [(i / 4, f) for f in judge.add(report, i / 4)]
    assert [f.rank for _, f in found] == [2, 2]  # at ~12 s, and again a window later
    first_at, first = found[0]
    assert 12.0 <= first_at < 16.0
    assert first.host == "node2" and first.score >= 0.15
    assert first.hot_frames == ("step (train.py:10) 100%",)
    assert found[1][0] - first_at >= 15.0


def test_balanced_ranks_taking_turns_at_being_last_are_not_stragglers() -> None:
    judge = StragglerJudge(window=15.0)
    for i, report in enumerate(_samples(slow=None, share=0.0, seconds=300)):
        assert judge.add(report, i / 4) == []


def test_nothing_is_judged_before_the_window_is_mostly_filled() -> None:
    judge = StragglerJudge(window=15.0)
    slow = _sample({0: True, 1: False})
    assert all(judge.add(slow, i / 4) == [] for i in range(40))  # 10 s: not yet
    assert [f.rank for f in judge.add(slow, 12.0)] == [1]


def _busy_machine(
    ranks: int, seconds: float, lone: dict[int, float], starved: int | None = None
) -> list[tuple[float, StackReport]]:
    """Four samples a second of balanced ranks on a busy machine, with their scheduler figures.

    Every rank waits for a CPU now and then (0-4 % of the time). Rank `lone[r]` works while the
    others wait in that share of the samples. Rank `starved` (if any) is descheduled in bursts
    (5 s in every 10): then it waits for a CPU 20-40 % of the time, most of it right after a
    sample that found it working (its wait shows in the next answer), and the others are found
    working while it waits in the collective that it has not returned from yet in 10 %.
    """
    rng = random.Random(11)
    cpu = dict.fromkeys(range(ranks), 0)
    queued = dict.fromkeys(range(ranks), 0)
    owed = 0  # run-queue time of `starved` that shows in its next answer
    samples = []
    for i in range(int(seconds * 4)):
        now = i / 4
        burst = starved is not None and now % 10 < 5
        for r in range(ranks):
            cpu[r] += rng.randrange(1_000_000, 3_000_000)
            queued[r] += rng.randrange(0, 10_000_000)  # 0-4 % of 0.25 s
        if burst and starved is not None:
            queued[starved] += owed + rng.randrange(20_000_000, 40_000_000)
            owed = 0
        waiting = dict.fromkeys(range(ranks), False)
        draw = rng.random()
        for r, share in lone.items():
            if draw < share:
                waiting = {o: o != r for o in range(ranks)}
                break
            draw -= share
        else:
            if burst and starved is not None and draw < 0.45:
                waiting = {o: o != starved for o in range(ranks)}
                owed = rng.randrange(40_000_000, 60_000_000)
            elif burst and draw < 0.55:  # the others work, `starved` still in the collective
                waiting = {o: o == starved for o in range(ranks)}
        report = StackReport(
            tuple(_stacks(r, w, sched=Sched(cpu[r], queued[r])) for r, w in waiting.items()),
            "sampled",
            0.0,
        )
        samples.append((now, report))
    return samples


def test_a_rank_starved_of_cpu_in_bursts_and_the_ranks_it_keeps_waiting_are_not_named() -> None:
    judge = StragglerJudge(window=15.0)
    found = [
        f for now, report in _busy_machine(2, 300, {}, starved=1) for f in judge.add(report, now)
    ]
    assert found == []


def _long_waits(seconds: float, wait: int) -> list[tuple[float, StackReport]]:
    """Four samples a second of 2 balanced ranks; in bursts (from every 10th second on, for
    5 s) rank 1 waits for a CPU for `wait` samples at a time, in which it seems to work (it
    does not run: its CPU time stands still) while rank 0 waits for it. An answer counts a wait
    once it ended: rank 1's show each wait at once, in the answer after it ran again."""
    rng = random.Random(5)
    cpu, queued = [0, 0], [0, 0]
    stuck_from: float | None = None  # when rank 1's wait began
    samples = []
    for i in range(int(seconds * 4)):
        now = i / 4
        waiting = {0: False, 1: False}
        cpu[0] += 1_000_000
        queued[0] += rng.randrange(0, 10_000_000)
        if stuck_from is not None and now - stuck_from >= wait / 4:  # it ran again
            queued[1] += int((now - stuck_from) * 1e9) - rng.randrange(0, 50_000_000)
            cpu[1] += 1_000_000
            stuck_from = None
        elif stuck_from is None and now % 10 < 5:
            stuck_from = now
        if stuck_from is not None:
            waiting[0] = rng.random() < 0.8
        elif cpu[1] and rng.random() < 0.06:  # balanced jitter
            waiting = {0: rng.random() < 0.5, 1: False}
            waiting[1] = not waiting[0]
        if stuck_from is None:
            cpu[1] += 1_000_000
            queued[1] += rng.randrange(0, 10_000_000)
        ranks = tuple(_stacks(r, waiting[r], sched=Sched(cpu[r], queued[r])) for r in (0, 1))
        samples.append((now, StackReport(ranks, "sampled", 0.0)))
    return samples


def test_a_rank_whose_long_waits_for_a_cpu_show_late_in_its_answers_is_not_named() -> None:
    for wait in (5, 12):  # 1.25 s, 3 s (a sample stays open 5 s)
        judge = StragglerJudge(window=15.0)
        found = [f for now, report in _long_waits(300, wait) for f in judge.add(report, now)]
        assert found == [], wait


def test_a_slow_rank_on_a_busy_machine_is_found_beside_a_starved_one() -> None:
    judge = StragglerJudge(window=15.0)
    found = [
        (now, f)
        for now, report in _busy_machine(4, 20, {2: 0.25}, starved=1)
        for f in judge.add(report, now)
    ]
    assert [f.rank for _, f in found] == [2]
    assert found[0][0] < 16.0


def _first_hang(
    judge: HangJudge, samples: list[tuple[float, StackReport]]
) -> tuple[float, HangError]:
    """When `judge` first raised HangError on `samples` (time, sample), and the error."""
    for now, report in samples:
        try:
            judge.add(report, now)
        except HangError as e:
            return now, e
    raise AssertionError("no hang found")


def test_every_rank_in_the_collective_with_no_new_one_begun_is_a_hang() -> None:
    judge = HangJudge(2.0)
    for i in range(8):  # all in all_reduce, but a new one each sample: progressing
        judge.add(_sample({0: True, 1: True}, progress=i), i / 4)
    judge.add(_sample({0: True, 1: True}, progress=8), 2.0)
    stuck = _sample({0: True, 1: True}, progress=8)
    now, error = _first_hang(judge, [(2.0 + i / 4, stuck) for i in range(1, 12)])
    assert now == 4.0
    assert "every rank waited in a collective" in str(error)
    assert error.stuck == ()
    assert error.seconds >= 2.0


def test_a_rank_that_keeps_working_is_no_hang_but_one_stuck_at_a_line_is() -> None:
    judge = HangJudge(1.0)
    for i in range(20):  # rank 1 works, its line changing: the others wait for it
        judge.add(StackReport((_stacks(0, True), _stacks(1, False, line=10 + i % 3)), "", 0), i)
    stuck = StackReport((_stacks(0, True), _stacks(1, False, line=50)), "", 0)
    now, error = _first_hang(judge, [(i, stuck) for i in range(20, 30)])
    assert now == 21
    assert "rank 0 waited in a collective while rank 1 did not join it" in str(error)
    assert error.stuck == (1,)


def test_no_rank_waiting_is_no_hang() -> None:
    judge = HangJudge(1.0)
    for i in range(30):
        judge.add(_sample({0: False, 1: False}), i)


def test_auto_waits_for_its_calibration_then_takes_a_multiple_of_the_longest_gap() -> None:
    judge = HangJudge("auto")
    for i in range(40):  # stuck from the start: no gap seen, nothing judged
        judge.add(_sample({0: True, 1: True}, progress=1), i)
    assert judge.limit() is None
    judge = HangJudge("auto")
    now = 0.0
    for step in range(6):  # a collective every 2 s
        judge.add(_sample({0: True, 1: True}, progress=step), now)
        now += 2.0
    assert judge.limit() == max(AUTO_FLOOR, AUTO_FACTOR * 2.0)
    stuck = _sample({0: True, 1: True}, progress=5)
    hung_at, _ = _first_hang(judge, [(now + i, stuck) for i in range(20)])
    assert hung_at - 10.0 == AUTO_FACTOR * 2.0  # the last progress was seen at 10 s


def test_a_pause_resets_the_hang_clock() -> None:
    judge = HangJudge(2.0)
    judge.add(_sample({0: True, 1: True}, progress=1), 0.0)
    judge.reset(5.0)  # a debugger session held the ranks until 5 s
    judge.add(_sample({0: True, 1: True}, progress=1), 6.0)
    now, _ = _first_hang(judge, [(7.0, _sample({0: True, 1: True}, progress=1))])
    assert now == 7.0


def test_a_silent_rank_keeps_the_place_it_was_last_seen_at() -> None:
    judge = HangJudge(1.0)
    judge.add(StackReport((_stacks(0, True), _stacks(1, False, line=50)), "", 0), 0.0)
    silent = RankStacks(1, "node1", 0, (), StackSource.SILENT)  # typed: no note is read
    now, error = _first_hang(
        judge, [(t / 4, StackReport((_stacks(0, True), silent), "", 0)) for t in range(1, 12)]
    )
    assert now == 1.0  # stuck since 0.0, where it was last seen
    assert error.stuck == (1,)


def test_a_silent_rank_while_the_others_wait_holds_them_back() -> None:
    judge = StragglerJudge(window=15.0)
    silent = RankStacks(1, "node1", 0, (), StackSource.SILENT)
    found = []
    for i in range(60):
        ranks = (_stacks(0, True), silent if i % 3 == 0 else _stacks(1, True))
        found += judge.add(StackReport(ranks, "", 0), i / 4)
    assert [f.rank for f in found] == [1]
    assert found[0].hot_frames == ("no answer (C code holding the GIL) 100%",)


def test_a_rank_half_way_to_a_straggler_is_suspected_early_and_balanced_ranks_are_not() -> None:
    judge = StragglerJudge(window=15.0)
    suspected_at = None
    for i, report in enumerate(_samples(slow=2, share=0.25, seconds=12)):
        judge.add(report, float(i))  # calm: a sample a second
        if judge.suspect and suspected_at is None:
            suspected_at = i
    assert suspected_at is not None and suspected_at < 10, suspected_at
    judge = StragglerJudge(window=15.0)
    balanced = _samples(slow=None, share=0.0, seconds=300)
    suspected = sum(bool(judge.add(r, i / 4) or judge.suspect) for i, r in enumerate(balanced))
    assert suspected < len(balanced) / 4, suspected  # mostly calm: a sample a second


def test_a_hang_is_suspected_from_the_first_sample_that_finds_every_rank_where_it_was() -> None:
    judge = HangJudge(60.0)
    judge.add(_sample({0: True, 1: False}), 0.0)
    assert not judge.suspect
    judge.add(_sample({0: True, 1: False}), 1.0)
    assert judge.suspect
    judge.add(_sample({0: True, 1: False}, progress=3), 2.0)
    assert not judge.suspect
