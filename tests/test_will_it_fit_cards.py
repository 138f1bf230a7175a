"""course_utils.will_it_fit's cards: every current NVIDIA card by name with its memory as sold, forgiving spellings,
a name sold in two sizes, an unknown name refused with the closest matches.

    .venv/bin/python -m pytest -q -n 0 tests/test_will_it_fit_cards.py
"""
import pytest

from course_utils.will_it_fit import CARD_SIZES, CARDS, DEFAULT_SIZE, WillItFitError, _card_key, card_note, parse_cards

# Memory as sold (GiB), per the vendor's product pages; the card a reader asks about first is the RTX 3060.
SOLD = {"RTX 3060 12GB": 12, "RTX 3060 8GB": 8, "RTX 3060 Ti": 8, "RTX 3070": 8, "RTX 3070 Ti": 8,
        "RTX 3080 10GB": 10, "RTX 3080 12GB": 12, "RTX 3080 Ti": 12, "RTX 3090": 24, "RTX 3090 Ti": 24,
        "RTX 4060": 8, "RTX 4060 Ti 8GB": 8, "RTX 4060 Ti 16GB": 16, "RTX 4070": 12, "RTX 4070 Super": 12,
        "RTX 4070 Ti": 12, "RTX 4070 Ti Super": 16, "RTX 4080": 16, "RTX 4080 Super": 16, "RTX 4090": 24,
        "RTX 5060 Ti 8GB": 8, "RTX 5060 Ti 16GB": 16, "RTX 5070": 12, "RTX 5070 Ti": 16, "RTX 5080": 16,
        "RTX 5090": 32, "RTX A2000 6GB": 6, "RTX A2000 12GB": 12, "RTX A4000": 16, "RTX A4500": 20,
        "RTX A5000": 24, "RTX A6000": 48, "RTX 6000 Ada": 48, "L4": 24, "L40S": 48, "T4": 16, "V100 16GB": 16,
        "V100 32GB": 32, "A10": 24, "A100 40GB": 40, "A100 80GB": 80, "H100": 80, "H200": 141}


def test_every_card_the_brief_names_is_known_with_its_memory_as_sold():
    for name, gib in SOLD.items():
        assert CARDS.get(name) == gib, (name, CARDS.get(name), gib)
        count, got, label = parse_cards(f"2x{name}")
        assert (count, got) == (2, gib) and label.startswith(f"2 x {name} ({gib} GiB"), (name, label)
    assert all(parse_cards(name)[:2] == (1, gib) for name, gib in CARDS.items())
    assert len({_card_key(name) for name in CARDS}) == len(CARDS), "two cards read alike"


@pytest.mark.parametrize("text", ["3060", "rtx3060", "RTX 3060", "2 x RTX 3060", "2xrtx3060-12gb", "GeForce RTX 3060",
                                  "2 × NVIDIA GeForce RTX 3060 12 GB", "2*rtx 3060 12GiB"])
def test_forgiving_spellings_of_the_rtx_3060(text):
    count, gib, label = parse_cards(text)
    assert gib == 12 and count == (2 if text.lstrip()[0] == "2" else 1), (text, count, gib)
    assert label.startswith(f"{count} x RTX 3060 12GB (12 GiB"), label


def test_a_bare_name_sold_in_two_sizes_is_the_default_or_asks_for_the_size():
    # the RTX 3060 launched with 12 GB and sells most so; the 8 GB one is a later, rarer variant: printed
    assert parse_cards("2 x RTX 3060") == (2, 12.0, "2 x RTX 3060 12GB (12 GiB)")
    note = card_note("2 x RTX 3060")
    assert note == "'RTX 3060' read as the 12 GB model, the one sold most: write RTX 3060 8GB for the other", note
    assert card_note("2xRTX 3060 12GB") == card_note("2x12GiB") == card_note("RTX 4090") == ""
    assert parse_cards("2xrtx3060-8gb")[1] == 8 and parse_cards("RTX 3080")[1] == 10
    assert set(DEFAULT_SIZE) <= {n for n, s in CARD_SIZES.items() if len(s) > 1}
    for name in ("RTX 4060 Ti", "RTX 5060 Ti", "A100", "V100", "RTX A2000"):   # both sizes sold alike: ask
        sizes = CARD_SIZES[name]
        with pytest.raises(WillItFitError, match=f"the {name} is sold with {sizes[0]} and {sizes[1]} GiB: write "
                                                 f"{name} {sizes[0]}GB or {name} {sizes[1]}GB"):
            parse_cards(f"2x{name.lower()}")
    assert parse_cards("8xA100-80")[:2] == (8, 80.0) and parse_cards("a100-40")[:2] == (1, 40.0)


def test_an_unknown_card_is_refused_in_one_line_with_the_closest_names():
    for text, close in (("2xRTX 3060 11GB", "RTX 3060 12GB"), ("RTX 4070Ti Supr", "RTX 4070 Ti Super"),
                        ("rtx 6000", "RTX 6000 Ada"), ("2 x 5090 Ti", "RTX 5090")):
        with pytest.raises(WillItFitError) as info:
            parse_cards(text)
        msg = str(info.value)
        assert "\n" not in msg and "unknown card" in msg and "; closest: " in msg, msg
        assert close in msg.split("; closest: ")[1].split(";")[0], (text, msg)
        assert "or give the memory, as in 2x16GiB" in msg, msg


def test_memory_given_as_a_number():
    assert parse_cards("2x16GiB") == (2, 16.0, "2 x 16 GiB") and parse_cards("2 x 12 GB")[:2] == (2, 12.0)
    assert parse_cards("24")[:2] == (1, 24.0) and parse_cards("4x7.5g")[:2] == (4, 7.5)
