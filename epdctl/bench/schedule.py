"""What a bench runs before it runs it: the arms' turns, how often each is brought up, the
rounds a verdict needs, and (once a round has run) about how long the rest takes."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")


def round_order(arms: Sequence[T], round_: int) -> list[T]:
    """Arms in alternating order: A B, then B A, then A B ..."""
    return list(arms) if round_ % 2 == 0 else list(arms)[::-1]


def turns(names: Sequence[str], rounds: int) -> list[tuple[int, str, bool]]:
    """Every (round, arm, whether it is brought up for this turn) in run_arms' order: an arm
    that runs last in one round and first in the next stays up."""
    out: list[tuple[int, str, bool]] = []
    up = None
    for round_ in range(rounds):
        for name in round_order(names, round_):
            out.append((round_, name, name != up))
            up = name
    return out


def starts(names: Sequence[str], rounds: int) -> dict[str, int]:
    """How often each arm is brought up in `rounds` rounds."""
    counts = dict.fromkeys(names, 0)
    for _, name, is_start in turns(names, rounds):
        counts[name] += is_start
    return counts


def fewest_rounds(arm_count: int) -> int:
    """The fewest rounds that give a verdict: the first that brings an arm up twice.

    A verdict weighs how far one start of an arm lands from the next (verdicts.py); only an
    arm brought up twice measures it, so with one start per arm there is no verdict at any
    number of requests. Two rounds (A B, B A) bring A up again: one degree of freedom, on cpu
    and cuda alike (the spread is measured on the machine, never assumed for a device). One
    arm compares with nothing: one round."""
    if arm_count < 2:
        return 1
    names = [str(i) for i in range(arm_count)]
    return next(r for r in itertools.count(1) if max(starts(names, r).values()) > 1)


def clock(seconds: float | None) -> str:
    """Whole seconds, as a stopwatch counts them (59.7 s is `59s`, then `1m00s`)."""
    if seconds is None:
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def describe(names: Sequence[str], requests: Sequence[int], rounds: int, warmup: int,
             max_rounds: int | None = None) -> list[str]:
    """The plan in two lines: the turns, the starts and load-point runs it costs (a start's
    time and a run's are not known before the first), and whether it can give a verdict.
    `requests`: each load point's."""
    count = starts(names, rounds)
    points = len(requests)
    sent = "/".join(str(n) for n in dict.fromkeys(requests))
    shown = " | ".join(" ".join(round_order(names, r)) for r in range(rounds))
    each = f", each followed by {warmup} warm-up requests" if warmup else ""
    lines = [f"plan: {rounds} round{'s' * (rounds > 1)}, arms in turn: {shown}; "
             f"{sum(count.values())} start{'s' * (sum(count.values()) > 1)} ("
             f"{', '.join(f'`{n}` {k}' for n, k in count.items())})"
             f"{each}; {points * len(names) * rounds} load-point runs ({points} point"
             f"{'s' * (points > 1)} x {len(names)} arm{'s' * (len(names) > 1)} x {rounds}) of "
             f"{sent} requests"]
    if max_rounds is not None and max_rounds > rounds:
        lines[0] += (f"; then up to {max_rounds} rounds while a verdict is undecided (at most "
                     f"{sum(starts(names, max_rounds).values())} starts and "
                     f"{points * len(names) * max_rounds} runs)")
    fewest = fewest_rounds(len(names))
    if len(names) < 2:
        lines.append("plan: one arm: figures only, nothing to compare")
    elif max(rounds, max_rounds or 0) < fewest:
        lines.append(f"plan: one start per arm: figures only, no verdict (how far one start "
                     f"of an arm lands from the next is not measured; --rounds {fewest} for "
                     "one)")
    else:
        again = [f"`{n}`" for n, k in starts(names, max(rounds, fewest)).items() if k > 1]
        lines.append(f"plan: a verdict weighs how far one start of an arm lands from the "
                     f"next (measured by bringing {', '.join(again)} up again); {fewest} "
                     "rounds are the fewest that give one, more decide smaller differences; "
                     f"--rounds 1: {len(names)} starts and {points * len(names)} runs, figures "
                     "without a verdict")
    return lines


def time_left(names: Sequence[str], rounds: int, from_round: int,
              start_s: Mapping[str, Sequence[float]], point_s: Mapping[tuple[str, int], float],
              points: int) -> float | None:
    """Seconds the turns from `from_round` up to `rounds` should take: each start as long as
    that arm's starts took, each load point as long as it last took on that arm (else on
    any arm). None: something not yet measured."""
    total = 0.0
    for round_, name, is_start in turns(names, rounds):
        if round_ < from_round:
            continue
        if is_start:
            took = start_s.get(name)
            if not took:
                return None
            total += sum(took) / len(took)
        for index in range(points):
            seconds = point_s.get((name, index))
            if seconds is None:
                seconds = next((s for (_, i), s in point_s.items() if i == index), None)
            if seconds is None:
                return None
            total += seconds
    return total
