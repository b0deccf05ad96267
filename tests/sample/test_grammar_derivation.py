"""Grammars whose `start` derives no finite text are refused when built (llguidance compiles
them): the productive-rule fixpoint over Lark's sequences, alternatives, groups and
repetitions, on GBNF too, and no verdict on syntax the reading does not follow."""

from __future__ import annotations

import pytest
from llguidance import LLMatcher

from brisk.sample.grammar import StructuredOutputs, check_start_derives


@pytest.mark.parametrize("lark, underivable", [
    ("start: x\nx: x", "start, x"),
    ('start: x\nx: "a" x', "start, x"),
    ('start: x y\nx: "a"\ny: y "b"', "start, y"),  # one part of a sequence is enough
    ('start: a\nc: a "x"\na: c', "start, a, c"),  # a cycle through two rules
    ('start: x+\nx: x', "start, x"),
    ('start: x{2}\nx: x', "start, x"),
    ('start: x ~ 1..3\nx: x', "start, x"),
    ('start: ("a" x | x "b")\nx: "(" x ")"', "start, x"),  # a group is as good as its best alternative
    ('start: x -> alias\n     | y\nx: x\ny: "b" y', "start, x, y"),  # aliases, continued alternatives
    ('start: y\n!y[capture]: x\n?x: "a" y', "start, y, x"),  # modifiers name the same rule
    ('%llguidance {}\n// a comment\nstart: x # another\n\nx: x\n', "start, x"),
])
def test_a_start_that_never_ends_in_terminals_is_refused_naming_the_rules(lark, underivable):
    assert LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(lark)) == ""  # llguidance accepts it
    with pytest.raises(ValueError, match=f"no finite derivation.*rules that never end in terminals: {underivable}\\)"):
        check_start_derives(lark)
    with pytest.raises(ValueError, match="no finite derivation"):
        StructuredOutputs(grammar=lark)


@pytest.mark.parametrize("lark", [
    'start: x\nx: "a" x | "b"',
    'start: x*\nx: x',  # repeated from zero, optional: the empty string
    'start: x?\nx: x',
    'start: [x]\nx: x',
    'start: x{0,3}\nx: x',
    'start: x{,3}\nx: x',
    'start: x ~ 0..2\nx: x',
    'start: (x\n  | "a")\nx: x',
    'start: "a" | x\nx: x',  # a dead alternative is not a dead start
    'start: a\na: b\nb: c\nc: "z"',  # defined after use
    'start: %json {"type": "object", "properties": {"a": {"type": "string"}}}\n',
    'start: A B\nA: "a" | /[0-9]+/\n%import common.B',  # imported names are terminals
    'start: x\n%declare x',
    'start: <|python_tag|> @fcall "a".."z"',
    'start: x\nx[stop="\\n", max_tokens=3]: /.*/',
    'start: x\nx.2: A "b"i\nA: /[a-z]+/ & ~"b"',
    'start: perm::0x0\nperm::_: "X" %if is_ones([0:3])\n   | "a" perm::set_bit(0) %if bit_clear(0)',  # no verdict
    'start: x\nx: x\n%unknown-statement',  # no verdict: llguidance's own error is the one given
])
def test_grammars_with_a_finite_derivation_or_no_verdict_pass(lark):
    check_start_derives(lark)


def test_gbnf_is_checked_as_the_lark_it_converts_to():
    StructuredOutputs(grammar='root ::= "The answer is " ("yes" | "no") "."')
    StructuredOutputs(grammar='root ::= x\nx ::= "a" x | [b-z]{2,5}')
    with pytest.raises(ValueError, match="no finite derivation"):
        StructuredOutputs(grammar='root ::= x\nx ::= "a" x')


def test_a_long_cycle_is_found_in_linear_time():
    """4,000 rules, each leading to the next and the last back to the first: one pass over the graph."""
    rules = "".join(f'r{i}: r{i + 1} "a" | "b" r{i + 1}\n' for i in range(4000))
    with pytest.raises(ValueError, match="start, r0, r1, r2"):
        check_start_derives("start: r0\n" + rules + "r4000: r0\n")
    check_start_derives("start: r0\n" + rules + 'r4000: "z"\n')


def test_a_grammar_of_too_many_rules_is_refused_before_llguidance_reads_it():
    """llguidance 1.9.1 segfaults on a chain of ~3,000 rules (2,500 pass): the test process
    itself would die if the chain reached it."""
    chain = "start: r0\n" + "".join(f'r{i}: r{i + 1} "a"\n' for i in range(3000)) + 'r3000: "z"\n'
    with pytest.raises(ValueError, match="more than 1000 rules"):
        StructuredOutputs(grammar=chain)
    ok = "start: r0\n" + "".join(f'r{i}: r{i + 1} "a"\n' for i in range(998)) + 'r998: "z"\n'
    assert StructuredOutputs(grammar=ok).grammar == ok
