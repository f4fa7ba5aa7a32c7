"""Rebalancing: which split of a running topology's devices between its roles would serve
the current traffic best, by tune's queue model and profiles, and whether moving there pays
for what the move costs (split: the splits a switch reaches; decide: the choice)."""
