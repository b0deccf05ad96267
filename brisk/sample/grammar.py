"""Structured outputs: per-step token masks from a grammar engine, so the sampled text always
matches a JSON schema, a regular expression, a list of choices or a context-free grammar.

The engine is llguidance (a Rust library with no Python dependencies; xgrammar, the other
choice, pulls in transformers and triton at run time). Its masks cost about 0.15 ms per
sequence and step on the default model's 49k vocabulary (docs/api.md's design notes have the overhead).

    StructuredOutputs   what a request asks for; checked when built, so a bad schema is a 400,
                        and so is a grammar whose start derives no finite text (check_start_derives)
    GrammarCompiler     one per engine: the tokenizer's token trie (built once, on first use)
                        and compiled grammars cached by spec; each sequence gets a copy
    Grammar             one sequence's place in its grammar, advanced on every accepted token
    fill_bitmask        the batch's masks in one parallel call, one bit per vocabulary entry
    apply_bitmask       those masks on the logits rows that have a grammar

A sequence whose grammar is complete can only produce EOS, and the engine ends it there.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import tokenizers
import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer, regex_to_lark
from llguidance.gbnf_to_lark import any_to_lark
from llguidance.numpy import fill_next_token_bitmask_par

from brisk.kernels.backend import KernelBackend

# JSON is written without free whitespace between tokens: small models left a choice spend
# their tokens on newlines and indentation, and the output is the same JSON value either way.
JSON_OPTIONS = {"whitespace_flexible": False}
_GRAMMAR_CACHE_SIZE = 256
# A constraint is compiled on the engine's thread, which every request shares: about 0.25 s for a
# grammar this size (a list of ~6,000 choices); 100,000 choices took 10 s and then failed.
MAX_GRAMMAR_CHARS = 128 * 1024
# llguidance 1.9.1 crashes the whole process (a segfault, in validate_grammar) on a chain of
# about 3,000 rules, each naming the next (2,500 pass): well under the character limit. Grammars
# people write have tens of rules; a thousand is refused before llguidance reads it.
MAX_GRAMMAR_RULES = 1000
_RULE_DEFINITION = re.compile(r"^[ \t]*[!?]?_?[a-z][_a-z0-9\-]*(?:\.[0-9]+)?[ \t]*:", re.MULTILINE)


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint: `json` (a JSON schema, as a dict or its text), `regex`, `choice`
    (the output is one of these strings), `grammar` (Lark, or llama.cpp's GBNF), or
    `json_object` (any JSON object). The names are vLLM's `StructuredOutputsParams` fields.
    Raises ValueError naming the problem when the constraint cannot be compiled."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    llguidance_grammar: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):  # key order kept: properties are written in the schema's order
            object.__setattr__(self, "json", json.dumps(self.json))
        elif self.json is not None and not isinstance(self.json, str):
            raise ValueError("the JSON schema must be an object")
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"exactly one of json, regex, choice, grammar or json_object must be given, got "
                             f"{given or 'none'}")
        object.__setattr__(self, "llguidance_grammar", self._compile(given[0]))
        if len(self.llguidance_grammar) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the {given[0]} constraint is {len(self.llguidance_grammar)} characters as a grammar; "
                             f"at most {MAX_GRAMMAR_CHARS} are accepted (it is compiled on the engine's thread)")
        if self.grammar is not None and len(_RULE_DEFINITION.findall(self.llguidance_grammar)) > MAX_GRAMMAR_RULES:
            raise ValueError(f"the grammar defines more than {MAX_GRAMMAR_RULES} rules; at most {MAX_GRAMMAR_RULES} "
                             f"are accepted")
        error = LLMatcher.validate_grammar(self.llguidance_grammar)
        if error:
            raise ValueError(f"the {given[0]} constraint is not valid: {error}")
        if self.grammar is not None:  # llguidance takes Lark as it is: this is the grammar's Lark text
            check_start_derives(self.llguidance_grammar)

    def _compile(self, kind: str) -> str:
        if kind == "json":
            try:
                schema = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from exc
            if not isinstance(schema, dict):
                raise ValueError("the JSON schema must be an object")
            return LLMatcher.grammar_from_json_schema(close_objects(schema), defaults=JSON_OPTIONS)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":  # \d and \w match ASCII only, as in JSON Schema's `pattern`
            return LLMatcher.grammar_from_lark(f"start: /{regex_to_lark(self.regex, 'dw')}/")
        if kind == "choice":
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        try:
            return LLMatcher.grammar_from_lark(any_to_lark(self.grammar))
        except Exception as exc:  # noqa: BLE001 - the converter raises whatever its parser meets
            raise ValueError(f"the grammar could not be read as Lark or GBNF: {exc}") from exc


def check_start_derives(lark: str) -> None:
    """Raises ValueError when the Lark grammar's `start` derives no finite text: every way of
    expanding it leads back to a rule still being expanded (`start: x`, `x: "a" x`), so nothing
    matches and a sequence under it could only run to max_tokens. llguidance compiles such a
    grammar without complaint. Syntax _Derivations does not follow (parametric rules, templates)
    gets no verdict: StructuredOutputs asks only once llguidance has found the grammar valid."""
    try:
        underivable = _Derivations(lark).underivable()
    except _Unreadable:
        return
    if "start" in underivable:
        raise ValueError("the grammar has no finite derivation: every expansion of `start` leads back to a rule "
                         f"being expanded (rules that never end in terminals: {', '.join(underivable[:10])})")


class _Unreadable(Exception):
    """Lark syntax _Derivations does not follow (or not Lark at all)."""


# llguidance's Lark tokens (parser/src/lark/lexer.rs), tried in this order; %json, %regex and
# %llguidance are followed by a JSON value, which the json module reads.
_LARK_TOKEN = re.compile(r"""
    (?P<skip>[ \t]+|(?:\#|//)[^\n]*)
  | (?P<newline>(?:\r?\n)+[ \t]*)
  | (?P<json>%(?:json|regex|llguidance)\b)
  | (?P<keyword>%[a-z]+)
  | (?P<string>"(?:\\.|[^"\\])*"i?)
  | (?P<regexp>/(?:\\.|[^/\\])+/[imslux]*)
  | (?P<special><[^<>\s]+>)
  | (?P<grammar_ref>@[A-Za-z0-9_\-]+)
  | (?P<number>0[xX][0-9a-fA-F]+|[+-]?[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)
  | (?P<name>!?[_?]?[a-z][_a-z0-9\-]*|_?[A-Z][_A-Z0-9\-]*)
  | (?P<punct>->|\.\.|::|[:.,=(){}\[\]~|&_+*?])
""", re.VERBOSE)
_SPACE = re.compile(r"\s*")
_SEQUENCE_ENDS = {"newline", "end", "|", "->", "&", "%if", ")", "]", "}"}
_MAX_NESTING = 30  # llguidance's own limit on nested groups


def _lark_tokens(lark: str) -> list[tuple[str, str]]:
    """(kind, text) pairs, ending with ("end", ""); punctuation and keywords are their own kind."""
    tokens, pos, decoder = [], 0, json.JSONDecoder()
    while pos < len(lark):
        match = _LARK_TOKEN.match(lark, pos)
        if match is None:
            raise _Unreadable
        kind, pos = match.lastgroup, match.end()
        if kind == "json":
            try:
                _, pos = decoder.raw_decode(lark, _SPACE.match(lark, pos).end())
            except (ValueError, RecursionError) as exc:  # RecursionError: nested past the json module's depth
                raise _Unreadable from exc
        if kind != "skip":
            tokens.append((match.group() if kind in ("punct", "keyword") else kind, match.group()))
    return tokens + [("end", "")]


class _Derivations:
    """A Lark grammar read as an and/or graph. A sequence derives finite text when all its parts
    do; a group of alternatives, and a rule, when one of them does; terminals (strings, regexes,
    %json, uppercase names, anything optional or repeated from zero) always do, and so do names
    the grammar does not define (imports, %declare: llguidance reports the undefined ones).
    Propagating up from those is the productive-nonterminal fixpoint, in time linear in the
    grammar's size. `&` counts as a sequence and `~` as a terminal: where unsure, a rule derives,
    so a grammar is never refused for what this reading misses."""

    def __init__(self, lark: str):
        self.tokens, self.pos, self.depth = _lark_tokens(lark), 0, 0
        self.needs: list[int] = []  # per node: how many more children must derive before it does
        self.parents: list[list[int]] = []
        self.rules: dict[str, int] = {}  # name -> its node, in the order names first appear
        self.defined: set[str] = set()
        self.terminal = self._node([], needs=0)
        while self._peek() != "end":
            self._item()

    def underivable(self) -> list[str]:
        """The defined rules that derive no finite text."""
        needs = list(self.needs)
        for name, node in self.rules.items():
            needs[node] = int(name in self.defined)
        ready = [node for node, count in enumerate(needs) if count == 0]
        while ready:
            for parent in self.parents[ready.pop()]:
                if needs[parent] > 0:
                    needs[parent] -= 1
                    if needs[parent] == 0:
                        ready.append(parent)
        return [name for name, node in self.rules.items() if needs[node] > 0]

    def _node(self, children: list[int], needs: int) -> int:
        self.needs.append(needs)
        self.parents.append([])
        for child in children:
            self.parents[child].append(len(self.needs) - 1)
        return len(self.needs) - 1

    def _rule(self, name: str) -> int:
        """A rule's node: its definitions are its alternatives, any one of which derives it."""
        name = name.lstrip("!?")  # `!rule:` keeps its terminals, `?rule:` is inlined: the same rule
        if name not in self.rules:
            self.rules[name] = self._node([], needs=1)
        return self.rules[name]

    def _peek(self, ahead: int = 0) -> str:
        return self.tokens[min(self.pos + ahead, len(self.tokens) - 1)][0]

    def _take(self, *kinds: str) -> str:
        kind, text = self.tokens[self.pos]
        if kind == "end" or (kinds and kind not in kinds):
            raise _Unreadable
        self.pos += 1
        return text

    def _count(self) -> int:
        try:
            return int(self._take("number"))
        except ValueError as exc:
            raise _Unreadable from exc

    def _item(self) -> None:
        kind = self._peek()
        if kind in ("%import", "%declare", "json"):  # names from elsewhere; %llguidance's options
            while self._peek() not in ("newline", "end"):
                self._take()
        elif kind == "%ignore":
            self._take()
            self._alternatives()
        elif kind != "newline":
            if kind == "%override":
                self._take()
            self._definition()
        if self._peek() != "end":
            self._take("newline")

    def _definition(self) -> None:
        name = self._take("name").lstrip("!?")
        rule = self._rule(name)
        if self._peek() in ("::", "{"):  # parametric rules, templates
            raise _Unreadable
        if self._peek() == ".":  # priority
            self._take()
            self._count()
        if self._peek() == "[":  # attributes: capture, lazy, stop, ...
            while self._take() != "]":
                pass
        self._take(":")
        self.parents[self._alternatives()].append(rule)
        self.defined.add(name)

    def _alternatives(self) -> int:
        self.depth += 1
        if self.depth > _MAX_NESTING:
            raise _Unreadable
        alternatives = [self._alternative()]
        while self._peek() == "|" or (self._peek() == "newline" and self._peek(1) == "|"):
            self.pos += 1 if self._peek() == "|" else 2
            alternatives.append(self._alternative())
        self.depth -= 1
        return self._node(alternatives, needs=1)

    def _alternative(self) -> int:
        conjuncts = [self._sequence()]
        while self._peek() == "&":
            self._take()
            conjuncts.append(self._sequence())
        if self._peek() == "->":  # an alias names the tree node, nothing more
            self._take()
            self._take("name")
        if self._peek() == "%if":  # parametric conditions
            raise _Unreadable
        return self._node(conjuncts, needs=len(conjuncts))

    def _sequence(self) -> int:
        parts = []
        while self._peek() not in _SEQUENCE_ENDS:
            parts.append(self._repeated())
        return self._node(parts, needs=len(parts))

    def _repeated(self) -> int:
        """An atom with its repetition, if any: none at all is a terminal (the empty string)."""
        atom, kind = self._atom(), self._peek()
        if kind in ("?", "*", "+"):
            self._take()
            return atom if kind == "+" else self.terminal
        least = 1
        if kind == "~" and self._peek(1) == "number":  # x ~ m or x ~ m..n
            self._take()
            least = self._count()
            if self._peek() == "..":
                self._take()
                self._count()
        elif kind == "{":  # x{m}, x{m,}, x{,n}, x{m,n}
            self._take()
            least = 0 if self._peek() == "," else self._count()
            if self._peek() == ",":
                self._take()
                if self._peek() != "}":
                    self._count()
            self._take("}")
        return atom if least > 0 else self.terminal

    def _atom(self) -> int:
        if self._peek() == "~":  # negation, of terminals only: whatever it negates, the result is one
            while self._peek() == "~":
                self._take()
            self._atom()
            return self.terminal
        kind, text = self._peek(), self._take()
        if kind in ("(", "["):
            inner = self._alternatives()
            self._take(")" if kind == "(" else "]")
            return inner if kind == "(" else self.terminal
        if kind == "name":
            if self._peek() == "::" or (self._peek() == "{" and self._peek(1) not in (",", "number")):
                raise _Unreadable  # a parametric rule or a template used
            return self._rule(text)
        if kind == "string" and self._peek() == "..":  # "a".."z"
            self._take()
            self._take("string")
        elif kind == "%lark":  # a nested grammar: llguidance checks it
            self._take("{")
            depth = 1
            while depth:
                depth += {"{": 1, "}": -1}.get(self._take(), 0)
        elif kind not in ("string", "regexp", "special", "grammar_ref", "json"):
            raise _Unreadable
        return self.terminal


# Where a JSON schema holds subschemas (and not values, as `const`, `enum` or `default` do).
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")


def close_objects(schema, close: bool = True):
    """The schema with `additionalProperties: false` on every object that lists its properties
    and says nothing about others, as vLLM's default grammar engine (xgrammar's strict mode)
    reads schemas and OpenAI's strict mode requires. Left open, a small model tends to invent
    property after property until max_tokens. A schema that sets additionalProperties keeps it;
    `allOf` members, and a schema with them, stay open, since each sees only part of the
    properties; values (`const`, `enum`, `default`, ...) are not touched."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(sub) for sub in out[key]]
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = [close_objects(s) for s in out[key]] if isinstance(out[key], list) else close_objects(out[key])
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [close_objects(sub, close=False) for sub in out["allOf"]]
        close = False
    if close and "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class Grammar:
    """One sequence's matcher. `accept` returns False for a token the grammar does not allow
    (it cannot happen for sampled tokens, whose logits were masked)."""

    def __init__(self, matcher: LLMatcher, executor: LLExecutor):
        self.matcher = matcher
        self.executor = executor

    def accept(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete (nothing may follow) or broken: the sequence must end."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    @property
    def error(self) -> str | None:
        """Why llguidance could not go on (a limit of its lexer, a schema with no finite
        instance), if it broke: the first line of its report."""
        return self.matcher.get_error().splitlines()[0] if self.matcher.is_error() else None


class GrammarCompiler:
    """Grammars for one tokenizer and vocabulary. `vocab_size` is the width of the model's
    logits, which may exceed the tokenizer's (those extra ids are never allowed)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self._backend = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()  # grammar -> untouched matcher, LRU order

    @cached_property
    def _tokenizer(self) -> LLTokenizer | ValueError:
        """The token trie llguidance walks: about 0.3 s for a 49k vocabulary, so built on first use
        (a tokenizer it cannot read is remembered as such, not tried again per request)."""
        try:
            return LLTokenizer(self._backend.to_str(), n_vocab=self.vocab_size, eos_token=self._eos or None)
        except ValueError as exc:  # llguidance reads byte-level BPE, SentencePiece and similar; not WordPiece
            return ValueError(f"structured outputs are not available for this model's tokenizer: {exc}")

    @cached_property
    def _executor(self) -> LLExecutor:
        return LLExecutor(num_threads=max(torch.get_num_threads(), 1))

    def grammar(self, spec: StructuredOutputs) -> Grammar:
        key = spec.llguidance_grammar
        pristine = self._compiled.get(key)
        if pristine is None:
            if isinstance(self._tokenizer, ValueError):
                raise ValueError(str(self._tokenizer))
            pristine = LLMatcher(self._tokenizer, key, log_level=0)
            if pristine.is_error():
                raise ValueError(f"the grammar could not be compiled: {pristine.get_error()}")
            first = pristine.deep_copy()  # its first mask, on a copy: a constraint no text satisfies fails here
            first.compute_bitmask()
            if first.is_error():
                raise ValueError(f"the constraint matches no text the model can write: "
                                 f"{first.get_error().splitlines()[0]}")
            self._compiled[key] = pristine
            if len(self._compiled) > _GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return Grammar(pristine.deep_copy(), self._executor)


def fill_bitmask(grammars: list[Grammar], vocab_size: int) -> torch.Tensor:
    """[len(grammars), ceil(V/32)] int32: bit j of row i is set if grammar i allows token j."""
    mask = np.full((len(grammars), (vocab_size + 31) // 32), -1, dtype=np.int32)
    fill_next_token_bitmask_par(grammars[0].executor, [(g.matcher, i) for i, g in enumerate(grammars)], mask)
    return torch.from_numpy(mask)


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor, kernels: KernelBackend) -> None:
    """Sets to -inf, in place, every logit of `rows` that the row's mask forbids (on CPU in one C
    pass over the bits; unpacking them to a [G, V] tensor first costs 5 ms at 32 rows)."""
    kernels.mask_rows(logits, rows, bitmask)
