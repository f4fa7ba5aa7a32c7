"""Options `bench` and `tune` share, defined once."""

from __future__ import annotations

import click

point_seconds_option = click.option(
    "--point-seconds", type=click.FloatRange(0), default=0.0, show_default=True,
    metavar="S", help="A request-rate point sends at least its rate x S requests, so that it "
    "lasts S seconds or more: at a high rate --num-prompts alone arrive in a moment, a burst "
    "that queues absorb within the SLO. 0: --num-prompts at every rate. With --trace: a "
    "speed sends at least the trace's mean rate there x S requests, the trace played again "
    "from its start past its end (a short trace).")
