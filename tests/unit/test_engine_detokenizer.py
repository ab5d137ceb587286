"""Incremental detokenizer (byte-level BPE) and stop-string matcher."""

from actors.worker.engine.detokenizer import (
    IncrementalDetokenizer,
    StopStringMatcher,
    bytes_to_unicode,
    complete_utf8_prefix_len,
    token_bytes_table,
    token_to_bytes,
)

B2U = bytes_to_unicode()


def byte_token(bs: bytes) -> str:
    """GPT-2 byte-level token string for raw bytes."""
    return "".join(B2U[b] for b in bs)


def make_vocab(pieces: list[bytes]) -> tuple[list[bytes], dict[bytes, int]]:
    tokens = ["<|im_end|>"] + [byte_token(p) for p in pieces]
    table = token_bytes_table(tokens, [3] + [1] * len(pieces))
    return table, {p: i + 1 for i, p in enumerate(pieces)}


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add_tokens([i]) for i in ids]


def test_bytes_to_unicode_is_a_bijection_of_256():
    assert len(B2U) == 256 and len(set(B2U.values())) == 256
    assert B2U[ord("A")] == "A" and B2U[ord(" ")] == "Ġ" and B2U[ord("\n")] == "Ċ"


def test_token_to_bytes_kinds():
    assert token_to_bytes("Ġhello", 1) == b" hello"
    assert token_to_bytes("<|im_end|>", 3) == b""
    assert token_to_bytes("<|im_end|>", 3, skip_special=False) == b"<|im_end|>"
    assert token_to_bytes("<0x0A>", 6) == b"\n"


def test_emoji_split_across_tokens_is_held_until_complete():
    emoji = "😀".encode()  # 4 bytes
    table, ids = make_vocab([emoji[:1], emoji[1:3], emoji[3:], b"ok"])
    detok = IncrementalDetokenizer(table)
    out = stream(detok, [ids[emoji[:1]], ids[emoji[1:3]], ids[emoji[3:]], ids[b"ok"]])
    assert out == ["", "", "😀", "ok"]


def test_cjk_split_bytes():
    text = "你好"
    raw = text.encode()  # 6 bytes, split unevenly
    parts = [raw[:2], raw[2:4], raw[4:]]
    table, ids = make_vocab(parts)
    out = stream(IncrementalDetokenizer(table), [ids[p] for p in parts])
    assert out == ["", "你", "好"]
    assert "".join(out) == text


def test_special_token_skipped_and_flush_drops_incomplete_tail():
    table, ids = make_vocab([b"hi", "é".encode()[:1]])
    detok = IncrementalDetokenizer(table)
    assert detok.add_tokens([ids[b"hi"], 0]) == "hi"
    assert detok.add_tokens([ids["é".encode()[:1]]]) == ""
    assert detok.flush() == ""  # held back at the end exactly as mid-stream: dropped, never U+FFFD


def test_stream_cut_inside_a_multibyte_character_ends_without_replacement_char():
    emoji = "🎉".encode()  # 4 bytes: the last token carries only its first 1..3
    for k in (1, 2, 3):
        table, ids = make_vocab([b"ok ", "é".encode(), emoji[:k]])
        detok = IncrementalDetokenizer(table)
        out = stream(detok, [ids[b"ok "], ids["é".encode()], ids[emoji[:k]]])
        out.append(detok.flush())
        assert "".join(out) == "ok é" and out[-2:] == ["", ""], k
        assert detok.flush() == ""  # nothing left behind


def test_invalid_bytes_before_an_incomplete_tail_are_still_replaced_at_flush():
    table, ids = make_vocab([b"a\xff" + "😀".encode()[:2]])  # invalid byte mid-stream, then a cut emoji
    detok = IncrementalDetokenizer(table)
    assert detok.add_tokens([1]) + detok.flush() == "a\ufffd"


def test_invalid_byte_becomes_replacement_not_stuck():
    table, ids = make_vocab([b"\xff", b"a"])
    detok = IncrementalDetokenizer(table)
    assert detok.add_tokens([ids[b"\xff"], ids[b"a"]]) == "\ufffda"


def test_complete_utf8_prefix_len():
    assert complete_utf8_prefix_len(b"ab") == 2
    assert complete_utf8_prefix_len("é".encode()[:1]) == 0
    assert complete_utf8_prefix_len(b"a" + "😀".encode()[:3]) == 1
    assert complete_utf8_prefix_len("😀".encode()) == 4


def feed_all(m: StopStringMatcher, deltas: list[str]) -> list[str]:
    return [m.feed(d) for d in deltas]


def test_stop_string_spanning_tokens_truncates_before_it():
    m = StopStringMatcher(("STOP",))
    assert feed_all(m, ["hello S", "TO", "P and more"]) == ["hello ", "", ""]
    assert m.stopped and m.flush() == ""


def test_partial_stop_prefix_released_when_not_completed():
    m = StopStringMatcher(("\n\nUser:",))
    assert feed_all(m, ["a\n", "\nUs", "ually"]) == ["a", "", "\n\nUsually"]
    assert not m.stopped


def test_partial_prefix_released_on_flush():
    m = StopStringMatcher(("END",))
    assert m.feed("the EN") == "the "
    assert m.flush() == "EN"


def test_earliest_of_several_stop_strings_wins():
    m = StopStringMatcher(("world", "lo w"))
    assert m.feed("hello world") == "hel"
    assert m.stopped


def test_stop_string_inside_one_delta():
    m = StopStringMatcher(("</s>",))
    assert m.feed("abc</s>def") == "abc"


def test_no_stop_strings_passes_through():
    m = StopStringMatcher(())
    assert feed_all(m, ["a", "b"]) == ["a", "b"] and m.flush() == ""
