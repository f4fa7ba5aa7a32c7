"""`epdctl tune`: candidates of a model on some devices (candidates), a queueing model that
predicts their goodput from profiled stage costs (model), and what picks the best (decide)."""
