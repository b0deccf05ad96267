"""Structured outputs: per-step token masks from a grammar engine, so the sampled text always
matches a JSON schema, a regular expression, a list of choices or a context-free grammar.

The engine is llguidance (a Rust library with no Python dependencies; xgrammar, the other
choice, pulls in transformers and triton at run time). Its masks cost about 0.15 ms per
sequence and step on the default model's 49k vocabulary (docs/benchmark-notes.md has the overhead).

    StructuredOutputs   what a request asks for; checked when built, so a bad schema is a 400
    GrammarCompiler     one per engine: the tokenizer's token trie (built once, on first use)
                        and compiled grammars cached by spec; each sequence gets a copy
    Grammar             one sequence's place in its grammar, advanced on every accepted token
    fill_bitmask        the batch's masks in one parallel call, one bit per vocabulary entry
    apply_bitmask       those masks on the logits rows that have a grammar

A sequence whose grammar is complete can only produce EOS, and the engine ends it there.
"""

from __future__ import annotations

import json
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
        error = LLMatcher.validate_grammar(self.llguidance_grammar)
        if error:
            raise ValueError(f"the {given[0]} constraint is not valid: {error}")

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
