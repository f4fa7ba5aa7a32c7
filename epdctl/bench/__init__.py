"""`epdctl bench`: one workload (`vllm bench serve`) against several arms on the same devices.

arms      which topologies run (the one written, an aggregated baseline derived from it, more)
workload  the load points, the `vllm bench serve` argv of each, and its result JSON
runner    brings each arm up through the run API, runs the workload, takes it down
report    figures, ratios to the baseline, verdicts; JSON and markdown
plot      plot.png (TTFT p90 and goodput against load), when matplotlib is installed
"""
