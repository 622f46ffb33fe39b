"""Bring-up: the offline LLM entry point; on Ray, placement group, head and EP worker actors."""
