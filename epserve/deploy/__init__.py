"""User-facing entry points: the CLI, `epserve serve`, the Ray Serve OpenAI app (build_app)."""
