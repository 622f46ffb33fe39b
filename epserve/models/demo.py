"""The built-in demo model: a tiny random-weight Qwen3-MoE checkpoint, built locally on first use.

Its text is random. The weights are random (``torch.manual_seed(0)``), so it streams real
tokens in meaningless order; it exists to run every part of the serving
path (tokenizer, chat template, MoE routing, EP, HTTP) without downloading anything.

Invariants: the folder ``<cache>/demo-qwen3-moe-v1/`` is either absent or complete. A build
goes into a temporary folder beside it and is renamed into place with ``os.replace``; the
marker file is written last, and a folder without it (a crash of an older, non-atomic build,
or a hand-made copy) is never used but replaced. Two processes racing both build, one rename
wins, the loser deletes its copy. The tokenizer is trained on the corpus embedded below, so
it is the same on every machine.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import time
import uuid

DEMO_NAME = "demo-qwen3-moe-v1"
MARKER = ".epserve-demo-complete"
CACHE_ENV = "EPSERVE_CACHE_DIR"

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
TOKENIZER_VOCAB = 2048

_BUILD_LOCK = threading.Lock()

# ChatML, as Qwen writes it. OpenAI-style content lists contribute their text parts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# The tokenizer's training text: written for this file, varied enough that byte-level BPE
# finds TOKENIZER_VOCAB - 259 merges. Changing it changes the tokenizer: bump DEMO_NAME.
_CORPUS = """\
The server reads a request, turns the prompt into tokens, and hands them to the scheduler.
Every step, the scheduler picks which sequences run: some decode one token, others prefill a
chunk of their prompt. The model answers with the next token of each row, and the server
streams the new text back to the client as soon as it is ready.
A mixture of experts replaces the single feed-forward network of each layer with many small
ones. A router scores every expert for every token and keeps the best few; only those experts
run, so the model holds far more weights than it reads for any one token. When the experts
live on different GPUs, each token's hidden state travels to the devices that own its experts
and the results travel back. That exchange happens twice in every layer, so it must be fast.
Memory for the attention keys and values is split into small blocks. A sequence owns a list
of blocks, and two sequences that share a prompt prefix can share its blocks, which saves both
memory and the time it would take to compute them again.
Yesterday it rained in the morning, but by noon the clouds had gone and the streets were dry.
We walked along the river to the old market, where a woman was selling apples, pears, plums,
honey, cheese, fresh bread and small jars of jam. The children wanted everything they saw.
In the evening we cooked a simple dinner: onions, garlic and tomatoes in olive oil, a pinch of
salt and pepper, then pasta, boiled for nine minutes in plenty of water. Nobody complained.
Questions people often ask: What time is it? Where are you going? How much does this cost?
Why did the build fail? Which version should I install? Can you explain it again, slowly?
Answers are not always short. Sometimes the honest answer is "I don't know yet", followed by a
plan to find out: measure first, then change one thing, then measure again.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 20 24 32 48 64 100 128 256 512 1000 1024 2048 4096.
Dates and times: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday; January,
February, March, April, May, June, July, August, September, October, November, December.
It was 3:45 pm on 12 May 2024 when the first results came in: 97.5% of requests finished in
under 120 ms, and the slowest one took 1.8 s. The team wrote it down and went home.
History: the first computers filled whole rooms and were programmed by moving cables. Later
came punched cards, then terminals, then personal computers on every desk, then phones in
every pocket. Each generation was smaller, cheaper and faster than the one before it, and each
one was used for things its builders never imagined.
Science asks simple questions with hard answers. Why is the sky blue? Because air scatters
short wavelengths of sunlight more than long ones. Why do leaves turn red and yellow in autumn?
Because the green chlorophyll breaks down and reveals the other pigments that were there all
along. Why does ice float? Because water expands as it freezes, so ice is less dense.
A short story. Once upon a time there was a lighthouse keeper who counted ships. Every night
she climbed the stairs, lit the lamp, and wrote in her notebook how many passed. One winter no
ship came for forty days. On the forty-first night a tiny boat appeared, and a boy waved at
her from the deck. She waved back, and then she wrote the number one, very carefully.
Instructions: open the box, remove the packing, and check that every part is present. Attach
the legs to the frame with the long screws. Do not tighten them fully until all four are in
place. Turn the table over, stand it on the floor, and then tighten every screw.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))

if __name__ == "__main__":
    main()
{"model": "demo", "messages": [{"role": "user", "content": "Hello!"}], "stream": true}
SELECT name, count(*) FROM orders WHERE status = 'open' GROUP BY name ORDER BY 2 DESC;
user: Hello, who are you?
assistant: I am a small demonstration model. My weights are random, so my words are too.
user: Can you write a poem about the sea?
assistant: The sea is wide, the sea is grey, it takes the sand and gives it back each day.
system: You are a helpful assistant. Answer briefly and politely.
Music, art and sport fill the weekends of many people. Some play the piano or the guitar,
some paint landscapes or portraits, and others run, swim, climb or ride bicycles through the
hills. A good teacher makes a hard skill look easy and an easy skill look interesting.
The library opens at nine and closes at six. Books may be borrowed for three weeks and renewed
twice, unless another reader has reserved them. Please return them to the desk, not the shelf.
Good software is boring in the right places: it starts quickly, fails loudly, logs what it did
and why, and never loses data. Its tests describe what a user would see, and a test that
cannot fail is removed. Its errors name the value that was wrong and the limit it broke.
Geography: mountains, valleys, deserts, forests, islands, lakes and glaciers. The longest
rivers cross several countries; their water feeds farms, cities and factories on the way to the
ocean. Maps show borders, roads, railways, airports, harbours and the height of the land.
Health advice that rarely changes: sleep enough, drink water, eat vegetables, walk outside
every day, and see a doctor when something hurts for more than a week. Wash your hands.
Kitchen inventory: flour, sugar, butter, eggs, milk, yeast, rice, beans, lentils, potatoes,
carrots, cabbage, spinach, lemons, oranges, bananas, grapes, strawberries, chocolate, coffee.
Animals of the farm and the wild: horse, cow, sheep, goat, pig, chicken, duck, goose, rabbit,
fox, wolf, bear, deer, eagle, owl, falcon, salmon, whale, dolphin, turtle, frog, bee, spider.
Jobs people do: baker, carpenter, electrician, engineer, farmer, journalist, lawyer, mechanic,
musician, nurse, pharmacist, pilot, plumber, researcher, sailor, surgeon, translator, writer.
Colours and shapes: black, white, purple, violet, brown, pink, silver, golden; circle, square,
triangle, rectangle, hexagon, sphere, cube, cylinder, pyramid, spiral, zigzag, diagonal.
Verbs of everyday life: arrive, borrow, build, carry, choose, climb, discover, divide, dream,
explore, forget, gather, imagine, improve, juggle, knock, laugh, lift, mend, organise, paint,
quarrel, recover, repair, rescue, search, shout, smile, travel, understand, whisper, wonder.
Adjectives: ancient, brave, brilliant, careful, clumsy, curious, delicate, eager, enormous,
famous, fragile, generous, gentle, gigantic, humble, jealous, loyal, mysterious, nervous,
peaceful, polite, precious, quiet, rapid, rough, shiny, smooth, stubborn, tiny, wise.
Physics and chemistry: energy, momentum, gravity, friction, velocity, acceleration, pressure,
temperature, oxygen, hydrogen, carbon, nitrogen, molecule, electron, photon, magnetic field.
Mathematics: addition, subtraction, multiplication, division, fractions, equations, matrix,
vector, probability, statistics, geometry, algebra, calculus, integral, derivative, theorem.
Transport: the train departs from platform seven at quarter past eight; the bus stops outside
the hospital; the ferry crosses the bay twice an hour; bicycles are welcome on weekends.
Letters to a friend: Dear Sam, thank you for the postcard from Lisbon. We miss you here, and
the garden is full of sunflowers. Write soon, and bring photographs. With love, Alex.
Punctuation and symbols: commas, semicolons; colons: dashes - brackets (round) [square]
{curly} <angle> quotes 'single' "double" ampersand & at @ hash # dollar $ percent % caret ^
asterisk * plus + equals = tilde ~ backslash \\ pipe | slash / underscore _ question ? bang !
"""


def default_cache_dir() -> pathlib.Path:
    """``$EPSERVE_CACHE_DIR``, else ``~/.cache/epserve``."""
    env = os.environ.get(CACHE_ENV)
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "epserve"


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a finished demo build (its marker exists)."""
    return (pathlib.Path(path) / MARKER).is_file()


def demo_model_path(cache_dir: str | os.PathLike | None = None,
                    progress: bool = True) -> pathlib.Path:
    """The demo checkpoint's folder, building it on first use (then reusing it).

    ``cache_dir`` defaults to ``default_cache_dir()``. ``progress`` shows a tqdm bar on stderr
    while building. The folder loads with ``transformers.AutoTokenizer`` /
    ``AutoModelForCausalLM`` and holds config.json, generation_config.json, model.safetensors,
    tokenizer.json and tokenizer_config.json (with the ChatML chat template).
    """
    root = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / DEMO_NAME
    if is_complete(target):
        return target
    # One build per process at a time: the build flips transformers' process-global progress
    # bar switch. Other processes race safely through _install.
    with _BUILD_LOCK:
        if is_complete(target):
            return target
        root.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(root)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}.tmp-", dir=root))
        try:
            _build(tmp, progress)
            _install(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _remove_abandoned(root: pathlib.Path, min_age_s: float = 3600.0) -> None:
    """Delete temporary and stale folders that crashed builds left; an hour old means no live
    builder still writes into them (a build takes seconds)."""
    now = time.time()
    for p in root.glob(f".{DEMO_NAME}.*"):
        try:
            if now - p.stat().st_mtime > min_age_s:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass  # another process removed it first


def _install(tmp: pathlib.Path, target: pathlib.Path) -> None:
    """Rename the finished ``tmp`` onto ``target``; lose the race gracefully, replace a broken one."""
    for _ in range(5):
        try:
            os.replace(tmp, target)
            return
        except OSError:
            # rename(2) refuses a non-empty target folder: someone else's build, or a broken one.
            if is_complete(target):
                return  # another process won; the caller deletes our copy
            aside = target.with_name(f".{DEMO_NAME}.stale-{uuid.uuid4().hex}")
            try:
                os.replace(target, aside)
            except OSError:
                continue  # it vanished or was replaced meanwhile: try again
            shutil.rmtree(aside, ignore_errors=True)
    if not is_complete(target):
        raise RuntimeError(f"could not install the demo model at {target}")


def _build(out: pathlib.Path, progress: bool) -> None:
    """Write the whole checkpoint into ``out``; the marker file last."""
    from tqdm import tqdm

    with tqdm(total=3, desc="epserve: building demo model", file=sys.stderr,
              disable=not progress, leave=False) as bar:
        bar.set_postfix_str("tokenizer")
        tokenizer = train_tokenizer()
        write_tokenizer(tokenizer, out)
        bar.update(1)
        bar.set_postfix_str("weights")
        model = _random_model(tokenizer)
        bar.update(1)
        bar.set_postfix_str("save")
        _save_model(model, out)
        bar.update(1)
    # mkdtemp made everything private; the cache is meant to be shared like a hub download.
    os.chmod(out, 0o755)
    for f in out.iterdir():
        os.chmod(f, 0o644)
    (out / MARKER).write_text(f"{DEMO_NAME}\n")


def train_tokenizer():
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on the embedded corpus: every string
    encodes (the 256 byte symbols are in the vocab) and decodes back unchanged."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    printable = "".join(chr(c) for c in range(32, 127))
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True) + [printable], trainer)
    return tok


def write_tokenizer(tok, out: pathlib.Path) -> None:
    """tokenizer.json plus a tokenizer_config.json that transformers 4.x and 5.x both read
    (the chat template lives in it, not in a separate chat_template.jinja)."""
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def demo_config(tokenizer):
    """The demo's ``Qwen3MoeConfig`` for a trained ``tokenizer``."""
    from transformers import Qwen3MoeConfig

    vocab = -(-tokenizer.get_vocab_size() // 64) * 64  # padded like real checkpoints
    return Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=128,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.token_to_id(IM_END),
        pad_token_id=tokenizer.token_to_id(ENDOFTEXT),
    )


def _random_model(tokenizer):
    """A randomly initialised ``Qwen3MoeForCausalLM`` in bf16 (seeded; the global RNG is
    left as it was)."""
    import torch
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    config = demo_config(tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(config)
    # bf16 on disk like real checkpoints; a float32 reference upcasts these values exactly.
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=None)
    return model


def _save_model(model, out: pathlib.Path) -> None:
    """``save_pretrained`` without transformers' own progress bar, then config.json rewritten
    in the shape Qwen's published checkpoints have (``num_experts``, ``rope_theta``,
    ``torch_dtype``), so loaders are exercised on the format they will meet; transformers 5
    reads both shapes."""
    from transformers.utils import logging as hf_logging

    bars_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out)
    finally:
        if bars_on:
            hf_logging.enable_progress_bar()
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    if "num_local_experts" in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")
    rope = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = rope.get("rope_theta", 10000.0)
    cfg["rope_scaling"] = None
    cfg["torch_dtype"] = cfg.get("dtype", "bfloat16")
    path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")
