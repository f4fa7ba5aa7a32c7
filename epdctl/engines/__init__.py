"""Engine launchers: how an engine process is started on a given platform."""
