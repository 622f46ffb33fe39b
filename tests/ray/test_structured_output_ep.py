"""Structured output under expert parallelism: ``LLM(ep_size=2)`` on the demo model (random
weights), sequences spread over both ranks, each row's token mask travelling in the encoded
step command to the rank that samples it. Every output validates against its schema, and the
greedy outputs equal one rank's."""

from __future__ import annotations

import json
import re

import jsonschema

from epserve import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 10},
                         "temp": {"type": "integer", "minimum": -40, "maximum": 50},
                         "sky": {"enum": ["clear", "cloudy", "rain"]}},
          "required": ["city", "temp", "sky"], "additionalProperties": False}
PROMPTS = ["Weather:", "Report for today", "JSON please", "The sky is", "Forecast", "Now:"]


def test_json_schema_under_ep2(ray_cluster, demo_model_dir):
    so = StructuredOutputsParams(json=SCHEMA)
    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=200,
                             structured_outputs=so)
    # greedy random weights would pick free whitespace forever: none allowed here
    tight = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    greedy = [SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=tight),
              SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={
                  "regex": r"\d{3}-[a-z]{2,4}"})] * 3
    ep = LLM(model=str(demo_model_dir), dtype="float32", seed=0, ep_size=2)
    try:
        outs = ep.generate(PROMPTS, sampled)
        want_greedy = ep.generate(PROMPTS, greedy)
    finally:
        ep.close()
    texts = [c.text for o in outs for c in o.outputs]
    assert len(texts) == 12 and all(c.finish_reason == "stop" for o in outs for c in o.outputs)
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    for o, sp in zip(want_greedy, greedy):
        c = o.outputs[0]
        assert c.finish_reason == "stop", (c.text, c.finish_reason)
        if sp.structured_outputs.kind == "json":
            jsonschema.validate(json.loads(c.text), SCHEMA)
        else:
            assert re.fullmatch(r"\d{3}-[a-z]{2,4}", c.text), c.text
    one = LLM(model=str(demo_model_dir), dtype="float32", seed=0)
    assert [o.outputs[0].token_ids for o in one.generate(PROMPTS, greedy)] == \
        [o.outputs[0].token_ids for o in want_greedy]
