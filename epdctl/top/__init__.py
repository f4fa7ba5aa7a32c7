"""`epdctl top`: sample (sources), summary (figures), view (screen), prom (parsing)."""
