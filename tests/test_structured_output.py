"""Structured output: grammar masks from llguidance, applied on the device before every other
logits processor.

With the real default model (SmolLM2-135M-Instruct), every output follows its JSON schema, regex,
choice or Lark grammar; with the tiny random model, the machinery: plain requests keep exactly their
tokens beside structured ones, a bad grammar fails its request alone, async scheduling holds a
structured request's masks are filled while its forward pass runs, and drafts are cut and masked by the grammar;
with the tiny model's tokenizer alone, grammars past llguidance's limits fail at compile time and say so, and JSON
whitespace is bounded.
"""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import jsonschema
import lark
import llguidance.numpy
import numpy as np
import pytest
from test_async_multistep import ENGINE

from jaxrunner import LLM, CachedRequestData, NewRequestData, Runner, RunnerConfig, SamplingParams, SchedulerOutput, StructuredOutputsParams
from jaxrunner.config import Kernels, SamplerConfig
from jaxrunner.engine.default_model import default_model, default_tokenizer
from jaxrunner.engine.structured_output import Grammar, GrammarCompiler, fill_bitmask, new_grammar
from jaxrunner.runner.pending_output import PendingOutput
from jaxrunner.sampling import build_sampling_metadata, mask_words, prepare_request, process_logits


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "population": {"type": "integer", "minimum": 1000}},
     "required": ["city", "population"]},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 3, "maxItems": 5},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 50},
                                      "unit": {"enum": ["C", "F"]}},
     "required": ["temperature", "unit"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1}, "email": {"type": "string", "maxLength": 30}},
        "required": ["id", "email"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "boolean"},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "count": {"type": "integer", "minimum": 0, "maximum": 10}},
     "required": ["ok", "count"], "additionalProperties": False},
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"type": "object", "properties": {"point": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2}},
     "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "minLength": 3, "maxLength": 30},
                                      "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                                      "genre": {"enum": ["drama", "comedy", "horror"]}},
     "required": ["title", "year", "genre"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["sku", "qty"], "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "object", "properties": {"status": {"const": "done"}, "code": {"type": "integer", "enum": [200, 404, 500]}},
     "required": ["status", "code"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["c"],
        "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}},
     "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 15},
                                      "nickname": {"type": ["string", "null"], "maxLength": 15}},
     "required": ["name", "nickname"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"],
     "additionalProperties": False},
    {"type": "array", "items": {"enum": ["north", "south", "east", "west"]}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "active": {"type": "boolean"}},
     "required": ["id", "active"], "additionalProperties": False},
]
REGEXES = {
    "Today's date, as YYYY-MM-DD:": r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "Call us at this US phone number:": r"\(\d{3}\) \d{3}-\d{4}",
    "An international phone number:": r"\+\d{1,3} \d{2,4} \d{3} \d{4}",
}
CHOICES = {"The capital of France is": ["Paris", "London", "Berlin"], "Is the sky green? Answer:": ["yes", "no"]}
ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term)~0..3
term: factor (("*" | "/") factor)~0..2
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""
# Room for any bare date (10 digit and dash tokens) or choice and its EOS: a text that does not match
# after 16 tokens matches after no more of them.
CHECKED = SamplingParams(temperature=0.0, max_tokens=16)


def structured(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=StructuredOutputsParams(**kwargs))


@pytest.fixture(scope="module")
def real_llm() -> LLM:
    return LLM(max_model_len=512, max_num_seqs=32, num_gpu_blocks_override=1100)  # a fixed cache: GPU tests hold two engines


@pytest.fixture(scope="module")
def real_outputs(real_llm):
    """Every structured request of the real-model tests, in one batch."""
    requests = [(f"Write one JSON value that follows this schema: {json.dumps(s)}\nJSON:", structured(json=s))
                for s in SCHEMAS]
    requests += [(p, structured(regex=r)) for p, r in REGEXES.items()]
    requests += [(p, structured(choice=c)) for p, c in CHOICES.items()]
    requests += [("An arithmetic expression that equals 12:", structured(grammar=ARITHMETIC))]
    outs = real_llm.generate([p for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)
    return [o.outputs[0] for o in outs]


def test_every_json_output_parses_and_follows_its_schema(real_outputs):
    for schema, out in zip(SCHEMAS, real_outputs):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_regex_outputs_match_whole(real_outputs):
    for regex, out in zip(REGEXES.values(), real_outputs[len(SCHEMAS):]):
        assert re.fullmatch(regex, out.text), (regex, out.text)


def test_choice_returns_one_of_the_choices_and_ends_there(real_llm, real_outputs):
    outs = real_outputs[len(SCHEMAS) + len(REGEXES):][: len(CHOICES)]
    for (prompt, choices), out in zip(CHOICES.items(), outs):
        assert out.text in choices and out.finish_reason == "stop"
        # The grammar ended the request on the choice's last token: no EOS step after it.
        assert out.token_ids == real_llm.get_tokenizer().encode(out.text, add_special_tokens=False)


def test_lark_grammar_output_parses(real_outputs):
    text = real_outputs[-1].text
    assert text and lark.Lark(ARITHMETIC).parse(text)


def test_json_on_a_prompt_that_does_not_ask_for_it_closes(real_llm):
    """Under any whitespace the model writes blank lines between the JSON tokens until max_tokens."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "name": {"type": "string"}}, "required": ["ok", "name"]}
    out = real_llm.generate(["Hello"], structured(json=schema), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), schema)


def test_the_masks_change_what_the_model_writes(real_llm, real_outputs):
    """Unconstrained, the model writes no bare choice and no fully-matching date: the grammar did it."""
    prompts = [*REGEXES][:1] + [*CHOICES][:1]
    free = [o.outputs[0].text for o in real_llm.generate(prompts, CHECKED, use_tqdm=False)]
    assert not re.fullmatch(REGEXES[prompts[0]], free[0]) and free[1] not in CHOICES[prompts[1]]
    asked = real_llm.llm_engine.runner.programs.asked
    assert any(key[0] == "sample" and key[2].grammar for key in asked)


def test_bitmask_on_the_device_matches_llguidance_reference():
    rng = np.random.default_rng(0)
    batch, vocab = 5, 1000
    logits = rng.normal(size=(batch, vocab)).astype(np.float32)
    masks = rng.integers(-2**31, 2**31, size=(batch, mask_words(vocab)), dtype=np.int64).astype(np.int32)
    masks[2] = -1  # a row without a grammar
    config = SamplerConfig()
    rows = [prepare_request(SamplingParams(temperature=1.0), i, 3, config, vocab) for i in range(batch)]
    md, flags = build_sampling_metadata(rows, [3] * batch, batch, config, vocab, grammar_bitmask=masks)
    assert flags.grammar
    got = np.asarray(process_logits(jnp.asarray(logits), md, flags, jnp.zeros((batch, 0), jnp.int32), Kernels.choose("reference")))
    want = logits.copy()
    llguidance.numpy.apply_token_bitmask_inplace(want, masks)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got[~np.isinf(got)], want[~np.isinf(want)], rtol=1e-6)
    assert np.isinf(want).sum() > batch * vocab // 3 and not np.isinf(got[2]).any()


# The tiny random model: random text, so the grammar does all the work.
PLAIN = [
    ("Hello, my name is", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
    ("Once upon a time", SamplingParams(temperature=0.9, seed=5, max_tokens=18, top_p=0.9)),
    ("abc", SamplingParams(temperature=1.0, seed=11, max_tokens=15, presence_penalty=0.4, logprobs=2)),
]
TINY_STRUCTURED = [
    ("Give a date:", SamplingParams(temperature=0.8, seed=1, max_tokens=30,
                                    structured_outputs=StructuredOutputsParams(regex=r"\d{4}-\d{2}-\d{2}"))),
    ("JSON:", SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"k": {"enum": ["aa", "bb"]}, "n": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["k", "n"], "additionalProperties": False}, disable_any_whitespace=True))),
    ("Pick:", SamplingParams(temperature=1.0, seed=2, n=2, max_tokens=10,
                             structured_outputs=StructuredOutputsParams(choice=["left", "right", "up"]))),
]


def tiny_generate(requests, **engine):
    llm = LLM(**{**ENGINE, "max_num_seqs": 8, "max_num_batched_tokens": 128, "num_gpu_blocks_override": 64} | engine)
    outs = llm.generate([p for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs], [o.error for o in outs], llm


def check_tiny_structured(outs) -> None:
    date, obj, picks = outs
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date[0][1])
    assert json.loads(obj[0][1])["k"] in ("aa", "bb")
    assert len(picks) == 2 and all(text in ("left", "right", "up") for _, text, _ in picks)


@pytest.fixture(scope="module")
def plain_alone():
    return tiny_generate(PLAIN, async_scheduling=False)[0]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_plain_requests_beside_structured_ones_keep_their_tokens(plain_alone, async_scheduling):
    outs, errors, _ = tiny_generate(PLAIN + TINY_STRUCTURED, async_scheduling=async_scheduling)
    assert outs[: len(PLAIN)] == plain_alone and not any(errors)
    check_tiny_structured(outs[len(PLAIN):])


def test_batch_invariant_structured_requests_give_the_same_outputs_alone_and_beside_others():
    """`batch_invariant=True` composes with grammars: the structured requests' outputs (their masks
    applied: they match) are the same alone and among plain requests."""
    llm = LLM(**{**ENGINE, "max_num_seqs": 8, "max_num_batched_tokens": 128, "num_gpu_blocks_override": 64},
              batch_invariant=True)
    outputs = lambda requests: [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in llm.generate(
        [p for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)]
    alone = [outputs([request])[0] for request in TINY_STRUCTURED]
    together = outputs(PLAIN + TINY_STRUCTURED)[len(PLAIN):]
    assert together == alone
    check_tiny_structured(together)


def test_structured_requests_come_back_whole_after_preemption():
    want = tiny_generate(PLAIN + TINY_STRUCTURED, async_scheduling=False)[0]
    outs, errors, llm = tiny_generate(PLAIN + TINY_STRUCTURED, num_gpu_blocks_override=13, block_size=8)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert outs == want and not any(errors)


def test_a_request_aborted_while_its_grammar_compiles_ends_there():
    llm = LLM(**ENGINE)
    engine = llm.llm_engine
    engine.add_request("a", "x", structured(json={"type": "object"}))
    engine.abort_request(["a"])
    outs = engine.step()
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in outs] == [("a", True, "abort")]
    while engine.has_unfinished_requests():
        assert not engine.step()
    assert not engine.scheduler.requests


def test_a_grammar_that_does_not_compile_fails_its_request_alone(plain_alone):
    bad = [
        ("x", structured(regex="[a-")),
        ("x", structured(json={"type": "object", "properties": {"a": {"type": "nonsense"}}})),
        ("x", structured(grammar="start: (")),
        ("x", structured(regex="a{1000000}")),  # past a limit that llguidance reports at the first token
    ]
    outs, errors, llm = tiny_generate(PLAIN + bad + TINY_STRUCTURED)
    assert outs[: len(PLAIN)] == plain_alone
    check_tiny_structured(outs[len(PLAIN) + len(bad):])
    failed = slice(len(PLAIN), len(PLAIN) + len(bad))
    for out, error, kind in zip(outs[failed], errors[failed], ["regex", "JSON schema", "grammar", "regex"], strict=True):
        assert out[0][2] == "error" and error.startswith(f"the {kind} ") and not out[0][0]
    assert "nonsense" in errors[len(PLAIN) + 1] and "lexer work limit" in errors[len(PLAIN) + 3]
    assert not llm.llm_engine.has_unfinished_requests()


# Grammars alone, for the tiny model's tokenizer: one token per character.
TINY_TOKENIZER = default_tokenizer()
EOS = TINY_TOKENIZER.eos_token_id


@pytest.fixture(scope="module")
def grammars():
    compiler = GrammarCompiler(TINY_TOKENIZER, len(TINY_TOKENIZER), [EOS])
    yield compiler
    compiler.shutdown()


def grammar(grammars: GrammarCompiler, **kwargs) -> Grammar:
    return new_grammar(grammars.compile(StructuredOutputsParams(**kwargs)).result())


def chars(text: str) -> list[int]:
    return TINY_TOKENIZER.encode(text, add_special_tokens=False)


def test_a_regex_past_a_limit_fails_at_compile_time_and_names_it(grammars):
    """llguidance takes a{1000000}, then its lexer runs out of work at the first token."""
    with pytest.raises(ValueError) as failed:
        grammar(grammars, regex="a{1000000}")
    message = str(failed.value)
    assert message.startswith("the regex goes past llguidance's lexer work limit") and "repetition counts" in message
    assert "JSON schema" not in message and len(message) < 300


def test_ten_thousand_choices_compile_and_big_grammars_fail_short(grammars):
    """As the alternatives of one Lark rule, 10,000 choices went past the parser's limit at the
    first token, with the whole grammar in the error."""
    choices = [f"option number {i}" for i in range(10_000)]
    choice = grammar(grammars, choice=choices)
    assert all(choice.accept(t) for t in chars(choices[-1])) and choice.stopped
    with pytest.raises(ValueError) as failed:
        grammar(grammars, grammar="start: " + " | ".join(map(json.dumps, choices)))
    message = str(failed.value)
    assert message.startswith("the grammar goes past llguidance's limit on the rules a parser row holds")
    assert "fewer alternatives" in message and len(message) < 400


def test_a_grammar_that_fails_while_generating_ends_in_error_not_stop(grammars):
    """Past its first token a grammar can still run out of a limit, and the copies of a template
    share its lexer: one request's failure leaves the others masks that allow EOS alone, and EOS
    ends them with the error, not as if their text were complete."""
    first, second = grammar(grammars, regex="(b|c)a{1000000}"), grammar(grammars, regex="(b|c)a{1000000}")
    assert first.accept(*chars("c")) and second.accept(*chars("c"))
    fill_bitmask([(first, [])], len(TINY_TOKENIZER))
    assert not first.accept(*chars("a"))
    mask = fill_bitmask([(second, [])], len(TINY_TOKENIZER))
    assert np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")).tolist() == [EOS]
    assert not second.accept(EOS)
    assert second.error == "lexer error: too many expressions constructed; past llguidance's lexer work limit"


def test_json_whitespace_is_bounded_and_compact_json_stays_compact(grammars):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "xs": {"type": "array", "items": {"type": "integer"}}}}
    value = {"ok": True, "xs": [1, 2]}
    pretty, spaced, compact = json.dumps(value, indent=4), json.dumps(value), json.dumps(value, separators=(",", ":"))
    cases = [
        ({"json": schema}, [pretty, spaced, compact], ["{\n\n\n", "{" + " " * 17, '{"ok"\n\n:']),
        ({"json": schema, "disable_any_whitespace": True}, [compact], [pretty, spaced]),
        ({"json": {**schema, "x-guidance": {"whitespace_flexible": False}}}, [compact], [pretty, spaced]),
    ]
    for kwargs, good, bad in cases:
        for text in good:
            json_grammar = grammar(grammars, **kwargs)
            assert all(json_grammar.accept(t) for t in chars(text)) and json_grammar.matcher.is_accepting(), (kwargs, text)
        for text in bad:
            assert len(grammar(grammars, **kwargs).valid_drafts(chars(text))) < len(chars(text)), (kwargs, text)


def recorded_steps(llm: LLM, monkeypatch) -> list[tuple[str, object]]:
    """What the engine does from now on, in order: ("forward", SchedulerOutput) for each
    execute_model, ("output", None) for each step output taken, ("sample", grammar masks)."""
    runner, events = llm.llm_engine.runner, []
    execute_model, sample_tokens, get = runner.execute_model, runner.sample_tokens, PendingOutput.get

    def forward(state, sched):
        events.append(("forward", sched))
        return execute_model(state, sched)

    def sample(state, masks=None):
        events.append(("sample", masks))
        return sample_tokens(state, masks)

    def output(pending):
        events.append(("output", None))
        return get(pending)

    monkeypatch.setattr(runner, "execute_model", forward)
    monkeypatch.setattr(runner, "sample_tokens", sample)
    monkeypatch.setattr(PendingOutput, "get", output)
    return events


def masked_steps(events: list[tuple[str, object]], req_id: str) -> list[tuple[object, np.ndarray]]:
    """(SchedulerOutput, grammar masks) of each step in which `req_id` sampled under a mask."""
    steps = [x for kind, x in events if kind == "forward"]
    masks = [x for kind, x in events if kind == "sample"]
    return [(s, m) for s, m in zip(steps, masks) if req_id in s.structured_output_request_ids]


def test_async_scheduling_fills_masks_while_the_forward_pass_runs(monkeypatch):
    """A structured request decodes every step, as the plain one does: its step's forward pass is
    dispatched, then the step before's output taken (the grammar takes its token), then the step
    samples under the mask filled meanwhile."""
    requests = PLAIN[:1] + TINY_STRUCTURED[:1]
    want = tiny_generate(requests, async_scheduling=False)[0]
    llm = LLM(**{**ENGINE, "max_num_seqs": 8, "max_num_batched_tokens": 128})
    events = recorded_steps(llm, monkeypatch)
    outs = llm.generate([p for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)
    assert [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs] == want
    forwards = [i for i, (kind, _) in enumerate(events) if kind == "forward"]
    masked = [n for n, i in enumerate(forwards) if "1" in events[i][1].structured_output_request_ids]
    assert len(masked) > 3 and all(b - a == 1 for a, b in zip(masked, masked[1:]))  # in step after step
    for n in masked[1:]:
        i = forwards[n]
        assert [kind for kind, _ in events[i : i + 3]] == ["forward", "output", "sample"]
        assert events[i + 2][1].shape == (1, mask_words(llm.llm_engine.model_config.vocab_size))
    # The grammar ended the request on the last step's token, taken after this step was dispatched:
    # this step's mask allows everything, and its token is dropped.
    assert outs[1].outputs[0].finish_reason == "stop" and (events[forwards[masked[-1]] + 2][1] == -1).all()
    assert not (events[forwards[masked[-2]] + 2][1] == -1).all()


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
REPEATING = [("aaaa", SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(
    regex=r"(ab){5,10}c")))]


@pytest.fixture(scope="module")
def without_drafts():
    """The drafts tests' requests without drafts, once for both schedulings."""
    return tiny_generate(PLAIN + TINY_STRUCTURED + REPEATING, async_scheduling=False)[0]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_drafts_and_grammar_work_together(without_drafts, async_scheduling):
    """Outputs equal those without drafts; drafts of the structured requests were accepted, each
    with a mask of its own."""
    outs, errors, llm = tiny_generate(PLAIN + TINY_STRUCTURED + REPEATING, speculative_config=NGRAM,
                                      async_scheduling=async_scheduling)
    assert outs == without_drafts and not any(errors)
    assert re.fullmatch(r"(ab){5,10}c", outs[-1][0][1])
    assert llm.llm_engine.stats().spec_decoding["num_accepted_tokens"] > 0


def test_structured_drafts_carry_a_mask_each(monkeypatch):
    llm = LLM(**{**ENGINE, "max_num_seqs": 8}, speculative_config=NGRAM)
    events = recorded_steps(llm, monkeypatch)
    out = llm.generate([p for p, _ in REPEATING], REPEATING[0][1], use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"(ab){5,10}c", out.text)
    drafted = [(s, m) for s, m in masked_steps(events, "0") if s.scheduled_spec_decode_tokens]
    assert drafted and all(m.shape[0] == 1 + len(s.scheduled_spec_decode_tokens["0"]) for s, m in drafted)
    assert all(-1 not in s.scheduled_spec_decode_tokens["0"] for s, _ in drafted)  # the host's copy of the device's


def test_draft_model_drafts_and_grammar_work_together():
    draft = {"method": "draft_model", "model": ENGINE["model"], "num_speculative_tokens": 2}
    want = tiny_generate(TINY_STRUCTURED + REPEATING, async_scheduling=False)[0]
    outs, errors, llm = tiny_generate(TINY_STRUCTURED + REPEATING, speculative_config=draft)
    assert outs == want and not any(errors)
    assert llm.llm_engine.stats().spec_decoding["num_accepted_tokens"] > 0


def test_the_grammar_cuts_drafts_it_does_not_allow(monkeypatch):
    """A host proposer offers drafts that leave the grammar: the scheduler keeps the valid prefix
    and the step carries a mask for each kept draft."""
    llm = LLM(**{**ENGINE, "max_num_seqs": 8}, speculative_config=NGRAM)
    tokenizer = llm.get_tokenizer()
    offered, asked = tokenizer.encode("abz", add_special_tokens=False), []
    llm.llm_engine.scheduler.proposer = lambda request, n: asked.append(n) or offered[:n]
    events = recorded_steps(llm, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=r"(ab)+c"))
    out = llm.generate(["x"], params, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"(ab)+c", out.text)
    drafts = [s.scheduled_spec_decode_tokens["0"] for s, _ in masked_steps(events, "0") if s.scheduled_spec_decode_tokens]
    # "z" never follows "ab" in the grammar: offered 3 drafts, a step keeps "ab" at most.
    assert 3 in asked and drafts and all(d == offered[: len(d)] and len(d) <= 2 for d in drafts)
    assert all(m.shape[0] == 1 + len(s.scheduled_spec_decode_tokens.get("0", ())) for s, m in masked_steps(events, "0"))


def test_structured_output_params_are_checked():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="non-empty strings"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
    llm = LLM(**ENGINE, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="need the tokenizer"):
        llm.generate([[5, 6]], structured(regex="a"), use_tqdm=False)


def test_runner_rejects_bad_masks_and_stays_usable():
    model, params = default_model()
    runner = Runner(model, params, RunnerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, num_blocks=16,
                                                block_size=8))
    state = runner.init_state()
    words = mask_words(model.vocab_size)
    new = NewRequestData("r", [5, 6, 7], ([0],), 0, SamplingParams(temperature=0.0))

    def sched(**kwargs):
        base = dict(scheduled_new_reqs=[new], num_scheduled_tokens={"r": 3}, total_num_scheduled_tokens=3)
        return SchedulerOutput(**base | kwargs)

    cases = {
        "go together": dict(structured_output_request_ids={"r": 0}),
        "int32 numpy array": dict(structured_output_request_ids={"r": 0}, grammar_bitmask=np.zeros((1, words), np.int64)),
        "do not fit": dict(structured_output_request_ids={"r": 1}, grammar_bitmask=np.zeros((1, words), np.int32)),
        "not scheduled": dict(structured_output_request_ids={"q": 0}, grammar_bitmask=np.zeros((1, words), np.int32)),
        "samples no token": dict(structured_output_request_ids={"r": 0}, grammar_bitmask=np.zeros((1, words), np.int32),
                                 num_scheduled_tokens={"r": 2}, total_num_scheduled_tokens=2),
    }
    for match, kwargs in cases.items():
        with pytest.raises(ValueError, match=match):
            runner.step(state, sched(**kwargs))
    only = np.zeros((1, words), np.int32)
    only[0, 9 // 32] = 1 << (9 % 32)  # token 9 alone
    state, out = runner.step(state, sched(structured_output_request_ids={"r": 0}, grammar_bitmask=only))
    assert out.sampled_token_ids == [[9]]

    # In two calls, bad masks leave the step waiting for good ones, and a second forward pass waits its turn.
    decode = SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["r"], [None], [3]), num_scheduled_tokens={"r": 1},
                             total_num_scheduled_tokens=1, structured_output_request_ids={"r": 0})
    state = runner.execute_model(state, decode)
    with pytest.raises(RuntimeError, match="call sample_tokens first"):
        runner.execute_model(state, decode)
    for masks in (None, np.zeros((1, words + 1), np.int32)):
        with pytest.raises(ValueError, match="grammar masks rejected"):
            runner.sample_tokens(state, masks)
    only[0, 9 // 32], only[0, 11 // 32] = 0, 1 << (11 % 32)  # token 11 alone
    state, pending = runner.sample_tokens(state, only)
    assert pending.get().sampled_token_ids == [[11]]
