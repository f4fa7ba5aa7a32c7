"""`python -m epdctl.rebalance.loop RUN_DIR`: the rebalancer of `up --rebalance`, a sidecar of
the run (launch.sidecars). Every `rebalance.every` it judges the traffic of the last
`window` (judge.judge); where a move pays and the last one is `min_gap` behind, it makes it
(the same switches `epdctl rebalance` makes, under the change lock: a user's change in
progress makes it wait a round). Each judgement is a line of `<run dir>/rebalance.jsonl`;
each move is in changes.jsonl with its reason. It leaves once the run is not running."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from epdctl.errors import EpdctlError
from epdctl.host.private import open_append
from epdctl.launch.state import RunState, StateDir

LOG = "rebalance.jsonl"
POLL_S = 1.0
DRAIN_S, START_TIMEOUT_S = 30.0, 600.0


def running(sdir: StateDir) -> RunState | None:
    try:
        state = sdir.read()
    except EpdctlError:
        return None
    return state if state.phase == "running" else None


def note(run_dir: Path, entry: dict[str, Any]) -> None:
    with open_append(run_dir / LOG) as f:
        f.write(json.dumps({"at": round(time.time(), 3), **entry}).encode() + b"\n")


def one_round(sdir: StateDir, state: RunState, may_move: bool) -> bool:
    """Judge once, and move where it pays and `may_move`; whether it moved."""
    from epdctl.launch.change import placer
    from epdctl.launch.live import one_change_at_a_time
    from epdctl.launch.rollout import Rollout
    from epdctl.rebalance.judge import Policy, judge, switch_plan
    from epdctl.topology.model import load_topology

    policy = Policy.of(state.settings.rebalance)
    decision, names = judge(sdir, state, policy)
    moving = decision.act and may_move
    note(sdir.path, {**decision.as_json(), "switches": names, "moved": moving})
    if not moving:
        return False
    print(f"epdctl rebalance: {decision.why}", file=sys.stderr, flush=True)
    with one_change_at_a_time(sdir):
        state = sdir.read()
        steps = switch_plan(decision)(placer(load_topology(state.topology_path), state,
                                             sdir.path), state)
        Rollout(sdir, f"rebalance: {decision.why}", DRAIN_S, START_TIMEOUT_S).run(steps)
    return True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    sdir = StateDir(Path(args[0]))
    started = last_move = time.monotonic()
    next_look, said = started, ""
    while (state := running(sdir)) is not None and state.settings.rebalance is not None:
        now, section = time.monotonic(), state.settings.rebalance
        if now >= next_look:
            next_look = now + section.every
            if now - started >= min(section.window, section.every):
                try:
                    if one_round(sdir, state, now - last_move >= section.min_gap):
                        last_move = time.monotonic()
                    said = ""
                except EpdctlError as exc:  # said once, until it changes
                    if str(exc) != said:
                        print(f"epdctl rebalance: {exc}", file=sys.stderr, flush=True)
                        note(sdir.path, {"error": str(exc)})
                    said = str(exc)
        time.sleep(POLL_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
