"""`verify`: fixed prompts against a topology and its aggregated twin (the baseline)."""
