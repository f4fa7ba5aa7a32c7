"""This machine: GPUs, /dev/shm, IPC directories, private files and modes, and signals."""
