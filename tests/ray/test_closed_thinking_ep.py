"""The closed-thinking mask under expert parallelism: ``LLM(ep_size=2,
reasoning_parser="qwen3")`` on the model that would think forever (tests/looping_ckpt.py),
rows spread over both ranks, each row's banned tags travelling in its sampling to the rank that
samples it. A block the model closed or the prompt closed never reopens, greedy and sampled,
and the greedy outputs equal one rank's."""

from __future__ import annotations

from looping_ckpt import make_looping_checkpoint

from epserve import LLM, SamplingParams


def test_closed_thinking_under_ep2(ray_cluster, demo_model_dir, tmp_path):
    model = make_looping_checkpoint(tmp_path, demo_model_dir)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=10, temperature=1.0, n=3, seed=7, ignore_eos=True)
    ep = LLM(model=str(model), dtype="float32", max_model_len=64, reasoning_parser="qwen3",
             ep_size=2)
    try:
        tok = ep.get_tokenizer()
        tags = set(tok.convert_tokens_to_ids(["<think>", "</think>"]))
        end = tok.convert_tokens_to_ids("</think>")
        prompts = [{"prompt_token_ids": tok.encode(t, add_special_tokens=False)} for t in
                   ("Hmm.</think><think>[[loop]]", "Hi<think>\n\n</think>",
                    "Hmm.</think><think>Hmm.</think><think>[[loop]]", "Go<think>\n\n</think>")]
        outs = {p: ep.generate(prompts, p) for p in (greedy, sampled)}
    finally:
        ep.close()
    for p, got in outs.items():
        for prompt, o in zip(prompts, got):
            closed_by_prompt = prompt["prompt_token_ids"][-1] == end
            for c in o.outputs:
                ids = c.token_ids
                after = ids if closed_by_prompt else ids[ids.index(end) + 1:]
                assert len(ids) == 10 and after and not tags & set(after), ids
    one = LLM(model=str(model), dtype="float32", max_model_len=64, reasoning_parser="qwen3")
    assert [o.outputs[0].token_ids for o in one.generate(prompts, greedy)] == \
        [o.outputs[0].token_ids for o in outs[greedy]]
