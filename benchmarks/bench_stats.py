"""bench's bootstrap, the stdlib way it was (one replicate at a time, `random`) against
numpy's (every replicate at once, `epdctl.bench.estimates.summarize`), side by side in one run.

    .venv/bin/python benchmarks/bench_stats.py [--rounds 3] [--requests 1000]
        [--resamples 2000] [--repeat 3]

Times one arm's summarize at one load point (the work bench does for every arm x point, and
tune again for each comparison), A B B A `--repeat` times; prints each arm's best and
median, ending with `stdlib_s=.. numpy_s=.. speedup=..` (best over best).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from epdctl.bench import stats  # noqa: E402
from epdctl.bench.samples import Round  # noqa: E402
from tests.bench.synthetic import make_round  # noqa: E402


def stdlib_summarize(rounds: Sequence[Round], seed: int, resamples: int) -> None:
    """The bootstrap as bench ran it before numpy: stats.figures per replicate, drawn with
    random.Random (within rounds, then over rounds), then the intervals."""
    rng = random.Random(seed)

    def resample(over: bool) -> dict[str, float | None]:
        chosen = [rng.choice(rounds) for _ in rounds] if over else rounds
        return stats.figures([(r, rng.choices(r.requests, k=len(r.requests)))
                              for r in chosen], False)

    draws = [resample(False) for _ in range(resamples)]
    over = [resample(True) for _ in range(resamples)]
    unit = min(len(r.requests) for r in rounds)
    for name in stats.FIGURES:
        values = [v for d in draws if (v := d[name]) is not None]
        spread = [v for d in over if (v := d[name]) is not None]
        if values and spread:
            stats.interval(spread, stats.LEVEL, unit)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--resamples", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    rng = random.Random(1)
    rounds = [make_round(rng, a.requests) for _ in range(a.rounds)]
    arms = {"stdlib": lambda: stdlib_summarize(rounds, 7, a.resamples),
            "numpy": lambda: stats.summarize(rounds, False, 7, a.resamples)}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(a.repeat):
        for name in ("stdlib", "numpy", "numpy", "stdlib"):
            started = time.perf_counter()
            arms[name]()
            times[name].append(time.perf_counter() - started)
    for name, ts in times.items():
        print(f"{name:<7} best {min(ts):.3f} s  median {statistics.median(ts):.3f} s")
    print(f"stdlib_s={min(times['stdlib']):.3f} numpy_s={min(times['numpy']):.3f} "
          f"speedup={min(times['stdlib']) / min(times['numpy']):.1f}")


if __name__ == "__main__":
    main()
