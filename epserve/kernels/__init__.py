"""Compute ops: each beside its pure-torch reference (the definition); no Ray, no models."""
