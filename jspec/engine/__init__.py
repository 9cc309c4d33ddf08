"""The serving engine: requests, the host-side scheduler, bursts of jitted steps, the LLM front door."""
