"""Rollouts: the agent loop (agent), trajectories (trajectory), tools, scenarios, strict JSON output
and a policy behind an OpenAI-compatible endpoint (remote)."""
