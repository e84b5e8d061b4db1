"""Serving: OpenAI-compatible routes (and, later, relayrl's own inference server)."""
