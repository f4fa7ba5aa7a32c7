"""`epdctl bench`: one workload (`vllm bench serve`) against several arms on the same devices.

arms      which topologies run (the one written, an aggregated baseline derived from it, more)
workload  the load points, the `vllm bench serve` argv of each, and its result JSON
schedule  the arms' turns and starts, the rounds a verdict needs, the time the rest takes
runner    brings the arms up in alternating rounds through the run API, runs the workload
counters  the proxy's /metrics and the store's counters around each load point, device names
samples   per-request samples of a load point (`--save-detailed`), saved in the report
stats     estimates over rounds and 95 % bootstrap intervals (pure Python)
verdicts  better / worse only where a ratio's interval clears the 5 % band (Bonferroni);
          with one start per arm, undecided
report    figures, intervals, ratios to the baseline, verdicts; JSON and markdown
compare   two saved reports side by side (`bench compare`)
plot      plot.png (TTFT and goodput against load, with intervals), with matplotlib
"""
