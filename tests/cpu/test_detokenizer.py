"""IncrementalDetokenizer: equals a whole decode, never emits partial characters, O(window)."""

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from epserve.head.detokenizer import IncrementalDetokenizer

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "日本語のテキストも少し入れておく。東京 京都 大阪",
    "café crème brûlée, naïve façade — ¿qué tal? Ünïcödé",
    "emoji 🙂 🚀 🎉 and math ∑ ∫ √ π ≈ 3.14159",
    "def f(x):\n    return x * 2  # code too\n",
]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    t.train_from_iterator(SENTENCES * 3, trainer)
    return t


class DecodeOnly:
    """A tokenizer the detokenizer knows only by its ``decode`` (no Rust backend to stream
    with): the Python-side window path."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        if name == "backend_tokenizer":
            raise AttributeError(name)
        return getattr(self.inner, name)


@pytest.fixture(scope="module", params=["stream", "window"])
def tok(request, bpe):
    """The same tokenizer through both paths: ``DecodeStream`` (Rust) and the Python window."""
    return bpe if request.param == "stream" else DecodeOnly(bpe)


def test_the_rust_stream_is_used_when_the_tokenizer_has_one(bpe):
    from transformers import PreTrainedTokenizerFast

    from epserve.head.detokenizer import rust_tokenizer

    assert rust_tokenizer(bpe) is bpe and rust_tokenizer(DecodeOnly(bpe)) is None
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    assert rust_tokenizer(hf) is hf.backend_tokenizer
    hf.clean_up_tokenization_spaces = True  # its decode is no longer the backend's
    assert rust_tokenizer(hf) is None


def run(tok, prompt, out_ids, skip=True):
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [d.add(t) for t in out_ids]
    deltas.append(d.finish())
    return d, deltas


def test_roundtrip_unicode_text(tok):
    text = "日本語 café 🙂 ok"
    ids = tok.encode(text).ids
    prompt = tok.encode("Prompt: ").ids
    d, deltas = run(tok, prompt, ids)
    assert d.text == text == "".join(deltas)
    assert deltas[-1] == ""  # nothing was held back at the end
    assert all("\ufffd" not in x for x in deltas)


def test_partial_character_is_held_back(tok):
    # Feed the single byte tokens of a 4-byte emoji: nothing shows until the last byte.
    byte_ids = [tok.token_to_id(c) for c in pre_tokenizers.ByteLevel(add_prefix_space=False)
                .pre_tokenize_str("🙂")[0][0]]
    assert len(byte_ids) == 4 and None not in byte_ids
    d = IncrementalDetokenizer(tok, [])
    assert [d.add(t) for t in byte_ids] == ["", "", "", "🙂"]


def test_finish_flushes_incomplete_bytes(tok):
    lead = tok.token_to_id(pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str("日")[0][0][0])
    ids = tok.encode("a").ids + [lead]
    d = IncrementalDetokenizer(tok, [])
    assert [d.add(t) for t in ids] == ["a", ""] and d.pending
    assert d.finish() == "\ufffd" and d.text == tok.decode(ids)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_matches_whole_decode_on_random_ids(tok, data, skip):
    v = tok.get_vocab_size()
    prompt = data.draw(st.lists(st.integers(0, v - 1), max_size=8))
    out = data.draw(st.lists(st.integers(0, v - 1), max_size=40))
    d, deltas = run(tok, prompt, out, skip)
    assert d.text == "".join(deltas) == tok.decode(out, skip_special_tokens=skip)
    # Only the final flush may carry a trailing replacement character.
    assert all(not x.endswith("\ufffd") for x in deltas[:-1])


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=40))
def test_matches_on_encoded_text(tok, text):
    ids = tok.encode(text).ids
    d, deltas = run(tok, tok.encode("x").ids, ids)
    assert d.text == tok.decode(ids) == text
    # Nothing is left for the final flush, unless the text itself ends in U+FFFD: that is
    # what an incomplete character decodes to, so it is held back until the end.
    assert deltas[-1] == "" or text.endswith("\ufffd")


class CountingTokenizer:
    """Wraps a tokenizer; records how many ids each decode call received."""

    def __init__(self, inner):
        self.inner, self.sizes = inner, []

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def _decode_sizes(tok, text):
    ids = tok.encode(text).ids
    counting = CountingTokenizer(tok)
    d = IncrementalDetokenizer(counting, tok.encode("prompt").ids)  # the window path
    counting.sizes.clear()
    for t in ids:
        d.add(t)
    d.finish()
    assert d.text == tok.decode(ids)
    return len(ids), counting.sizes


def test_cost_per_token_is_a_window_not_the_length(tok):
    text = " ".join(SENTENCES)
    n1, sizes1 = _decode_sizes(tok, text)
    n8, sizes8 = _decode_sizes(tok, text * 8)
    assert n8 > 8 * n1 - 8
    # Two decodes per token, each over a window (a few tokens; longer only while a character
    # spans several tokens): the largest window does not grow with the output length.
    assert max(sizes8) == max(sizes1) <= 16
    assert sum(sizes8) <= 8 * n8


def test_transformers_tokenizer_is_accepted(bpe):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    ids = bpe.encode("naïve 🙂 fox").ids + [bpe.token_to_id("<eos>")]
    d, _ = run(hf, [], ids)
    assert d.text == hf.decode(ids, skip_special_tokens=True) == "naïve 🙂 fox"


@pytest.mark.parametrize("path", ["stream", "window"])
def test_metaspace_keeps_the_leading_space_the_prompt_gives(path):
    vocab = {"<unk>": 0, "▁The": 1, "▁capital": 2, "▁is": 3, "▁Paris": 4, ".": 5}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.decoder = decoders.Metaspace()
    assert t.decode([4, 5]) == "Paris."  # a whole decode strips the first space
    d, deltas = run(t if path == "stream" else DecodeOnly(t), [1, 2, 3], [4, 5])
    assert deltas[:2] == [" Paris", "."] and d.text == " Paris."  # as vLLM streams it
