"""Developer tools: tiny offline models for tests and CPU demos."""
