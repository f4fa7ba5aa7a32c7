"""The simulated GPU machine: N fake GPUs (epdctl.host.gpus, $EPDCTL_FAKE_GPUS) and a fake engine
(`python -m epdctl.sim.engine`) that speaks what `vllm serve` speaks for E, P, PD and D, with
service times from a cost-model file (epdctl.sim.costmodel; format in docs/tune.md)."""
