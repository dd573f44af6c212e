"""The endpoints beyond chat, through the official Python SDKs: OpenAI's Responses API and
embeddings, Anthropic's and Gemini's token counting, Gemini embeddings, single-model
lookups, and unknown paths answered in their caller's format (issue 12)."""

import anthropic
import httpx
import openai
import pytest

from conftest import EMBED_MODELS, MODELS, wait_for
from test_sdks import an, gm, oa, requests_in_ledger


def row_of(gw, request_id):
    return gw.request_row(request_id)


# --- OpenAI Responses API --------------------------------------------------------------------

def test_responses_create_whole(gateway):
    # spec: A1, M2, I1
    raw = oa(gateway).responses.with_raw_response.create(model=MODELS["openai"], input="hello")
    resp = raw.parse()
    assert resp.output_text.startswith("Queues absorb bursts")
    assert resp.id.startswith("resp_")
    assert (resp.usage.input_tokens > 0, resp.usage.output_tokens) == (True, 12)
    row = row_of(gateway, raw.headers["x-request-id"])
    assert (row["endpoint"], row["state"], row["stream"]) == ("/v1/responses", "done", 0)
    assert (row["output_tokens"], row["reasoning_tokens"], row["cached_input_tokens"]) == (12, 0, 0)
    assert row["input_tokens"] == resp.usage.input_tokens


def test_responses_stream_is_its_typed_event_stream(gateway):
    # spec: A1, H1, M2
    raw = oa(gateway).responses.with_raw_response.create(model=MODELS["openai"], input="hello", stream=True)
    types_seen, text = [], ""
    for ev in raw.parse():
        types_seen.append(ev.type)
        if ev.type == "response.output_text.delta":
            text += ev.delta
        if ev.type == "response.completed":
            usage = ev.response.usage
    assert types_seen[0] == "response.created" and types_seen[-1] == "response.completed"
    assert "response.output_text.delta" in types_seen
    assert text.startswith("Queues absorb bursts") and usage.output_tokens == 12
    row = row_of(gateway, raw.headers["x-request-id"])
    assert (row["endpoint"], row["state"], row["stream"], row["output_tokens"]) == ("/v1/responses", "done", 1, 12)
    assert row["first_token_at"] is not None


def test_responses_stream_fails_over_before_its_first_event(gateway_factory):
    # spec: D2, H2
    gw = gateway_factory(group=2)
    a, b = gw.groups["openai"]
    gw.sim.set(a, fault={"kind": "cut_before_first_token"})
    raw = oa(gw).responses.with_raw_response.create(model=MODELS["openai"], input="hello", stream=True)
    events = [ev.type for ev in raw.parse()]
    assert events[-1] == "response.completed" and "error" not in events
    assert gw.group_calls("openai") == [1, 1]
    assert raw.headers["x-spillway-channel"] == b


def test_responses_stream_cut_after_output_is_an_error_event_not_a_failover(gateway_factory):
    # spec: H2, H3
    gw = gateway_factory(group=2)
    a, _ = gw.groups["openai"]
    gw.sim.set(a, fault={"kind": "cut_after_first_token", "after_tokens": 3})
    raw = oa(gw).responses.with_raw_response.create(model=MODELS["openai"], input="hello", stream=True)
    events = list(raw.parse())
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 3
    assert events[-1].type == "error", [e.type for e in events]
    assert raw.headers["x-request-id"] in events[-1].message
    assert gw.group_calls("openai") == [1, 0], "output was shown: the request is not run again"
    row = row_of(gw, raw.headers["x-request-id"])
    assert (row["state"], row["partial_output_committed"]) == ("failed", 1)


def test_stored_responses_are_followed_up_on_the_channel_that_stored_them(gateway_factory):
    # spec: D4, I1
    gw = gateway_factory(group=2)
    a, b = gw.groups["openai"]
    # The first channel (the preferred one) fails: the response is stored on the second.
    gw.sim.set(a, fault={"kind": "status", "status": 503})
    client = oa(gw)
    raw = client.responses.with_raw_response.create(model=MODELS["openai"], input="hello")
    first = raw.parse()
    assert raw.headers["x-spillway-channel"] == b
    assert row_of(gw, raw.headers["x-request-id"])["response_id"] == first.id
    gw.sim.set(a, fault={"kind": "ok"})
    before = gw.group_calls("openai")
    # GET reaches the channel that holds it, though the first channel is healthy again.
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    assert list(client.responses.input_items.list(first.id)) == []
    # The next turn follows it there too, streamed or not.
    nxt = client.responses.with_raw_response.create(model=MODELS["openai"], input="and then?",
                                                    previous_response_id=first.id)
    assert nxt.headers["x-spillway-channel"] == b
    with client.responses.stream(model=MODELS["openai"], input="more", previous_response_id=nxt.parse().id) as s:
        assert s.get_final_response().status == "completed"
    assert gw.group_calls("openai") == [before[0], before[1] + 4]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)  # the provider deleted it
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve("resp_not_made_here")
    assert "with this API key" in e.value.message
    assert gw.group_calls("openai")[0] == before[0], "nothing went to the channel that does not hold it"


def test_responses_take_a_list_of_input_items(gateway):
    # spec: A1, A5
    client = oa(gateway)
    resp = client.responses.create(model=MODELS["openai"], input=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
    ])
    assert resp.output_text.startswith("Queues absorb bursts")


def test_another_keys_stored_response_cannot_be_continued_or_read(gateway_factory):
    # spec: B5, D4
    other = "sk-other-" + "b" * 24
    gw = gateway_factory(key_yaml=f"  - name: other\n    owner: team-a\n    secret_env: OTHER_KEY",
                         env={"OTHER_KEY": other})
    first = oa(gw).responses.create(model=MODELS["openai"], input="mine")
    stranger = openai.OpenAI(base_url=gw.url + "/v1", api_key=other, max_retries=0)
    calls = gw.calls("openai")
    with pytest.raises(openai.NotFoundError) as e:
        stranger.responses.create(model=MODELS["openai"], input="and then?", previous_response_id=first.id)
    assert "with this API key" in e.value.message
    with pytest.raises(openai.NotFoundError):
        stranger.responses.retrieve(first.id)
    assert gw.calls("openai") == calls, "nothing reached the provider for the stranger"


def test_a_stored_response_is_found_while_it_still_streams(gateway_factory):
    # spec: D4
    gw = gateway_factory(group=2)
    for ch in gw.groups["openai"]:
        gw.sim.set(ch, tokens_per_second=20)
    client = oa(gw)
    rid, found = None, None
    for ev in client.responses.create(model=MODELS["openai"], input="slowly", stream=True):
        if ev.type == "response.created":
            rid = ev.response.id
        elif ev.type == "response.output_text.delta" and found is None:
            # Output has begun; the stream runs for about half a second more.
            found = client.responses.retrieve(rid)
    assert found is not None and found.id == rid


@pytest.mark.parametrize("fault,runs_again", [
    ({"kind": "status", "status": 500}, False),
    ({"kind": "cut_before_first_token"}, False),
    ({"kind": "status", "status": 503}, True),
    ({"kind": "status", "status": 429}, True),
])
def test_a_request_whose_provider_may_act_is_not_run_twice(gateway_factory, fault, runs_again):
    # spec: D2, E2, F2
    gw = gateway_factory(group=2)
    a, b = gw.groups["openai"]
    gw.sim.set(a, fault=fault)
    stream = fault["kind"] == "cut_before_first_token"
    body = {"model": MODELS["openai"], "input": "file the ticket", "stream": stream,
            "tools": [{"type": "mcp", "server_label": "tickets", "server_url": "https://mcp.example",
                       "require_approval": "never"}]}
    r = httpx.post(f"{gw.url}/v1/responses", headers={"authorization": f"Bearer {gw.key}"}, json=body, timeout=20)
    if runs_again:
        # The provider answered that it did not start: the next channel may run it.
        assert r.status_code == 200 and gw.group_calls("openai") == [1, 1]
        return
    assert r.status_code >= 500, r.text
    assert gw.group_calls("openai") == [1, 0], "a hosted tool may have run: not sent again"
    row = gw.request_row(r.headers["x-request-id"])
    att = gw.attempts(row["id"])
    assert [(x["decision"], x["decision_reason"]) for x in att] == [("fail_closed", "provider_may_have_acted")]


def test_responses_refuses_a_body_without_model_naming_the_field(gateway):
    # spec: A5
    r = httpx.post(f"{gateway.url}/v1/responses", headers={"authorization": f"Bearer {gateway.key}"},
                   json={"input": "hello"})
    assert r.status_code == 400
    assert "`model`" in r.json()["error"]["message"]
    assert gateway.calls("openai") == 0


# --- Embeddings -----------------------------------------------------------------------------

def test_openai_embeddings(gateway):
    # spec: A1, M2
    raw = oa(gateway).embeddings.with_raw_response.create(model=EMBED_MODELS["openai"], input=["one", "two"])
    emb = raw.parse()
    assert [d.index for d in emb.data] == [0, 1] and len(emb.data[0].embedding) == 8
    assert emb.usage.prompt_tokens > 0
    row = row_of(gateway, raw.headers["x-request-id"])
    assert (row["endpoint"], row["state"], row["requested_model"]) == ("/v1/embeddings", "done", EMBED_MODELS["openai"])
    assert row["input_tokens"] == emb.usage.prompt_tokens


def test_embeddings_fail_over_across_channels_of_the_model(gateway_factory):
    # spec: D2
    gw = gateway_factory(group=2)
    a, b = gw.groups["openai"]
    gw.sim.set(a, fault={"kind": "status", "status": 503})
    raw = oa(gw).embeddings.with_raw_response.create(model=EMBED_MODELS["openai"], input="one")
    assert len(raw.parse().data) == 1
    assert gw.group_calls("openai") == [1, 1]
    assert (raw.headers["x-spillway-channel"], raw.headers["x-spillway-attempts"]) == (b, "2")


def test_idempotency_keys_hold_for_embeddings_and_responses(gateway):
    # spec: I2
    client = oa(gateway)
    for create in (
        lambda h: client.embeddings.with_raw_response.create(model=EMBED_MODELS["openai"], input="once", extra_headers=h),
        lambda h: client.responses.with_raw_response.create(model=MODELS["openai"], input="once", extra_headers=h),
    ):
        before = gateway.calls("openai")
        key = {"Idempotency-Key": f"k-{before}"}
        first, again = create(key), create(key)
        assert again.headers["x-spillway-idempotent-replay"] == "true"
        assert again.headers["x-spillway-replay-of"] == first.headers["x-request-id"]
        assert again.text == first.text
        assert gateway.calls("openai") == before + 1, "the repeat made no upstream call"


def test_gemini_embeddings_one_and_batch(gateway):
    # spec: A1
    client = gm(gateway)
    one = client.models.embed_content(model=EMBED_MODELS["gemini"], contents="one")
    assert len(one.embeddings) == 1 and len(one.embeddings[0].values) == 8
    many = client.models.embed_content(model=EMBED_MODELS["gemini"], contents=["one", "two", "three"])
    assert len(many.embeddings) == 3
    # The single form by hand too (the SDK may batch even one text).
    r = httpx.post(f"{gateway.url}/v1beta/models/{EMBED_MODELS['gemini']}:embedContent",
                   headers={"x-goog-api-key": gateway.key}, json={"content": {"parts": [{"text": "one"}]}})
    assert r.status_code == 200 and len(r.json()["embedding"]["values"]) == 8
    row = row_of(gateway, r.headers["x-request-id"])
    assert (row["endpoint"], row["requested_model"]) == ("/v1beta/models/{model}:embedContent", EMBED_MODELS["gemini"])
    r = httpx.post(f"{gateway.url}/v1beta/models/{EMBED_MODELS['gemini']}:embedContent",
                   headers={"x-goog-api-key": gateway.key}, json={})
    assert r.status_code == 400 and r.json()["error"]["status"] == "INVALID_ARGUMENT"
    assert "`content`" in r.json()["error"]["message"]


# --- Token counting -------------------------------------------------------------------------

def test_anthropic_count_tokens_is_not_billed_nor_rated(gateway_factory):
    # spec: A1, B1, M1
    gw = gateway_factory(key_yaml="    rpm: 1")
    client = an(gw)
    client.messages.create(model=MODELS["anthropic"], max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    # The minute's one request is spent; counting still goes through, twice.
    for _ in range(2):
        raw = client.messages.with_raw_response.count_tokens(
            model=MODELS["anthropic"], messages=[{"role": "user", "content": "how many?"}])
        assert raw.parse().input_tokens > 0
        row = row_of(gw, raw.headers["x-request-id"])
        assert (row["endpoint"], row["state"], row["cost_usd"]) == ("/v1/messages/count_tokens", "done", 0.0)
    with pytest.raises(anthropic.RateLimitError):
        client.messages.create(model=MODELS["anthropic"], max_tokens=16, messages=[{"role": "user", "content": "hi"}])


def test_count_tokens_takes_from_the_rate_when_the_key_says_so(gateway_factory):
    # spec: B1
    gw = gateway_factory(key_yaml="    rpm: 1\n    rpm_counts_token_counting: true")
    client = an(gw)
    msgs = [{"role": "user", "content": "how many?"}]
    client.messages.count_tokens(model=MODELS["anthropic"], messages=msgs)
    with pytest.raises(anthropic.RateLimitError):
        client.messages.count_tokens(model=MODELS["anthropic"], messages=msgs)


def test_gemini_count_tokens(gateway):
    # spec: A1
    client = gm(gateway)  # held: a dropped client closes its connection pool
    got = client.models.count_tokens(model=MODELS["gemini"], contents="how many tokens is this?")
    assert got.total_tokens > 0
    def row():
        with gateway.db() as con:
            return con.execute("SELECT endpoint, cost_usd, state FROM requests").fetchone()

    assert wait_for(lambda: requests_in_ledger(gateway) == 1 and row()[2] == "done")
    assert tuple(row()) == ("/v1beta/models/{model}:countTokens", 0.0, "done")


# --- Single models and unknown paths ---------------------------------------------------------

def test_each_format_looks_up_one_model(gateway):
    # spec: A1, A3
    assert oa(gateway).models.retrieve(MODELS["openai"]).id == MODELS["openai"]
    assert an(gateway).models.retrieve(MODELS["anthropic"]).id == MODELS["anthropic"]
    client = gm(gateway)
    assert client.models.get(model=MODELS["gemini"]).name == f"models/{MODELS['gemini']}"
    with pytest.raises(openai.NotFoundError):
        oa(gateway).models.retrieve("no-such-model")
    with pytest.raises(anthropic.NotFoundError):
        an(gateway).models.retrieve("no-such-model")
    r = httpx.get(f"{gateway.url}/v1beta/models/no-such-model", headers={"x-goog-api-key": gateway.key})
    assert r.status_code == 404 and r.json()["error"]["status"] == "NOT_FOUND"
    # A Gemini SDK on `v1` asks under /v1/models with its own key header; an OpenAI
    # fine-tuned model's id has colons and is still OpenAI's.
    r = httpx.get(f"{gateway.url}/v1/models/{MODELS['gemini']}", headers={"x-goog-api-key": gateway.key})
    assert r.status_code == 200 and r.json()["name"] == f"models/{MODELS['gemini']}"
    r = httpx.get(f"{gateway.url}/v1/models/ft:gpt-4o-mini:org::abc", headers={"authorization": f"Bearer {gateway.key}"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path,headers,shape", [
    ("/v1/messages/batches", {"x-api-key": "K", "anthropic-version": "2023-06-01"}, "anthropic"),
    ("/v1beta/models/gemini-2.5-flash:predict", {"x-goog-api-key": "K"}, "gemini"),
    ("/v1beta/cachedContents", {"x-goog-api-key": "K"}, "gemini"),
    ("/v1/audio/speech", {"authorization": "Bearer K"}, "openai"),
])
def test_unknown_endpoints_answer_404_in_their_callers_format(gateway, path, headers, shape):
    # spec: A3
    headers = {k: v.replace("K", gateway.key) for k, v in headers.items()}
    r = httpx.post(gateway.url + path, headers=headers, json={})
    assert r.status_code == 404
    body = r.json()
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    elif shape == "gemini":
        assert body["error"]["status"] == "NOT_FOUND"
    else:
        assert body["error"]["code"] == "unknown_url" or body["error"]["type"] == "invalid_request_error"
    message = body["error"]["message"]
    assert f"POST {path}" in message, message
    assert "x-request-id" in r.headers
