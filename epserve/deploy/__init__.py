"""User-facing entry points: the CLI and (later) the Ray Serve OpenAI app and deploy YAML."""
