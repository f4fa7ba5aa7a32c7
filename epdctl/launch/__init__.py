"""A topology placed and run on this machine: the plan, the EC connectors' part of it, the
preflight checks, the run API, its processes, supervisor and state."""
