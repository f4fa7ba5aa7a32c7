"""epdctl: one command for a vLLM Encoder/Prefill/Decode topology on one machine."""

__version__ = "0.1.0"
