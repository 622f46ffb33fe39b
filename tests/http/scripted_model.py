"""A tiny Qwen3-MoE checkpoint whose greedy output is a script: the next token is a fixed function
of the last one, so a prompt's last token picks which scripted text the real engine generates.

How: every attention ``o_proj`` and expert ``down_proj`` is zero, so each block adds nothing to
the residual stream, which stays the last token's embedding; each scripted token's embedding is
a one-hot column of its own, and ``lm_head`` maps that column to the token's successor with a
logit of 80 against 0 for every other token, so even sampling follows the script (every other
token maps to ``<|im_end|>``, the end). The tokenizer is the demo model's with Qwen3's
``<think>`` / ``<tool_call>`` tags and the script's pieces added as tokens, and a chat template
of Qwen3's shape (tools in the system turn, ``<tool_call>`` history, ``<tool_response>`` turns,
``enable_thinking``). Nothing in the serving path is replaced: the engine runs this model as any
other, and the server's parsers see the text it detokenizes.
"""

from __future__ import annotations

from pathlib import Path

import torch

IM_END = "<|im_end|>"
# Qwen3's tags, and "\n\n" as one token as in Qwen's vocabulary (so the prompt that ends
# "</think>\n\n" ends in another token than the one that ends "assistant\n")
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "\n\n"]

# Written for these tests in the shape of Qwen3's template (not a copy of it).
TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- '<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and '
    'arguments within <tool_call></tool_call> XML tags.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}
{{- message.content }}
{%- if message.tool_calls %}
{%- for call in message.tool_calls %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
{%- if call.function.arguments is string %}{{- call.function.arguments }}
{%- else %}{{- call.function.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
""".strip()


def _tokenizer(demo_dir: Path, pieces: list[str]):
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_dir))
    tok.add_tokens([AddedToken(p, normalized=False, special=False) for p in pieces])
    tok.chat_template = TEMPLATE
    return tok


def make_scripted_checkpoint(out: Path, demo_dir: Path, scripts: dict[str, list[str]],
                             nothink: list[str], default: list[str]) -> Path:
    """Write the checkpoint into ``out``. ``scripts``: trigger token -> the pieces generated
    after it (each an added token; the end follows). ``default``: the pieces after the
    generation prompt; ``nothink``: after the generation prompt with ``enable_thinking``
    false. Every piece and trigger may appear once in all scripts together."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    pieces = TAGS + list(scripts) + [p for s in (*scripts.values(), nothink, default) for p in s]
    pieces = list(dict.fromkeys(pieces))
    tok = _tokenizer(demo_dir, pieces)
    user = [{"role": "user", "content": "Hi"}]

    def last_token(**kw) -> int:
        text = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True, **kw)
        return tok.encode(text, add_special_tokens=False)[-1]
    gen_end, off_end = last_token(), last_token(enable_thinking=False)
    assert gen_end != off_end, "the two generation prompts must end in different tokens"
    eos = tok.convert_tokens_to_ids(IM_END)
    succ: dict[int, int] = {}
    chains = [(gen_end, default), (off_end, nothink)]
    chains += [(tok.convert_tokens_to_ids(t), s) for t, s in scripts.items()]
    for start, chain in chains:
        ids = [start] + [tok.convert_tokens_to_ids(p) for p in chain] + [eos]
        for a, b in zip(ids, ids[1:]):
            assert succ.get(a, b) == b, f"token {tok.convert_ids_to_tokens(a)!r} is scripted twice"
            succ[a] = b
    hidden = 128
    assert len(succ) < hidden, "more scripted tokens than hidden dimensions"
    vocab = -(-len(tok) // 64) * 64
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos,
                         pad_token_id=tok.pad_token_id or 0, norm_topk_prob=True)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        emb = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        # logit 80 for the successor, 0 for every other token: the script even when sampled
        emb[:, 0] = 1.0                 # column 0: every unscripted token ...
        head[eos, 0] = 10.0             # ... is followed by the end
        for col, (a, b) in enumerate(sorted(succ.items()), start=1):
            emb[a, :] = 0.0
            emb[a, col] = 1.0
            head[b, col] = 10.0
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


# ------------------------------------------------------------------ the tests' scripts

WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'
REASONING = "The user asks for the weather in Paris.\nI will call get_weather."
#: after the generation prompt (thinking on): reasoning, then one call split across tokens
DEFAULT = ["<think>", "The user asks for the weather in Paris.", "\nI will call get_weather.",
           "</think>", '\n\n<tool_call>\n{"name": "get_', 'weather", "arguments": {"city": ',
           '"Paris", "unit": "celsius"}}', "\n</tool_call>"]
#: after the generation prompt with enable_thinking false: an answer, no thinking
NOTHINK = ["It is sunny", " in Paris today."]
SCRIPTS = {
    # content, then two calls: the tags whole, then each split over two tokens
    "[[two]]": ["Checking both cities.", "<tool_call>",
                '{"name": "get_weather", "arguments": {"city": "Paris"}}', "</tool_call>",
                "\n<tool_", 'call>\n{"name": "get_time", ',
                '"arguments": {"zone": "CET"}}\n</tool', "_call>"],
    # after a prefilled "<think>": the rest of the thinking, then the answer
    "[[implicit]]": [" so the answer is 4.", "</think>\n\nThe answer", " is 4."],
    # text that starts like the tags but is none of them
    "[[plain]]": ["Use a <tool", "box> and 1 < 2", " </thinking> ok <tool_c"],
    # a block that is no call (its body is not JSON)
    "[[bad]]": ["<tool_call>{name: get_weather}</tool_call>"],
}
PLAIN_TEXT = "Use a <toolbox> and 1 < 2 </thinking> ok <tool_c"
BAD_TEXT = "<tool_call>{name: get_weather}</tool_call>"


def build(out: Path, demo_dir: Path) -> Path:
    return make_scripted_checkpoint(out, demo_dir, SCRIPTS, NOTHINK, DEFAULT)
