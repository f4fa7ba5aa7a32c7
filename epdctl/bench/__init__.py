"""`epdctl bench`: one workload (`vllm bench serve`, or a replayed trace) against several arms
on the same devices.

arms      which topologies run (the one written, an aggregated baseline derived from it, more)
workload  the load points, the `vllm bench serve` argv of each, and its result JSON
tracefile `--trace FILE`: what bench reports and checks of the trace
senders   what sends a workload (`vllm bench serve`, or the replayer for --trace / --mix)
replay    `python -m epdctl.bench.replay`: a trace's requests at its times, vLLM's result file
bodies    the chat request a trace line becomes (prompt words, generated media)
client    a chat request timed as vLLM times it, and vLLM's result figures (the sim's too)
images    generated PNGs (bench's datasets, tune's probes, the replayer, the sim's loadgen)
schedule  the arms' turns and starts, the rounds a verdict needs, the time the rest takes
runner    brings the arms up in alternating rounds through the run API, runs the workload
counters  the proxy's /metrics and the store's counters around each load point, device names
samples   per-request samples of a load point (`--save-detailed`), saved in the report
stats     estimates over rounds and 95 % bootstrap intervals (pure Python)
verdicts  better / worse only where a ratio's interval clears the 5 % band (Bonferroni);
          with one start per arm, undecided
by_class  a trace's figures, ratios and verdicts per shape class
report    figures, intervals, ratios to the baseline, verdicts; JSON and markdown
compare   two saved reports side by side (`bench compare`)
plot      plot.png (TTFT and goodput against load, with intervals), with matplotlib
"""
