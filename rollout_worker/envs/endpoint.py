"""An OpenAI-compatible chat endpoint in front of the rollout worker's engine, recording every call per episode.

An agent written against the OpenAI SDK is trained unmodified: it is given a base URL and talks to it as to any
OpenAI-compatible server, while every completion it receives is kept, as ids and logprobs, for training
(``calls`` turns them into samples; ``agent.AgentTask`` runs the agents).  One ``ChatEndpoint`` serves a worker:
a stdlib HTTP server in a background thread, on 127.0.0.1 and an OS-chosen port unless told otherwise.

URL scheme.  The path names the episode: ``open()`` gives the episode's base URL
``http://127.0.0.1:PORT/episodes/<episode_id>/v1``, and ``OpenAI(base_url=that, api_key="anything")`` is the whole
setup.  The path was chosen over the API key or the model name because the base URL is the one setting every SDK and
agent framework exposes and passes through untouched, while keys and model names are often hard-coded.

  POST /episodes/<id>/v1/chat/completions   one completion, recorded in episode <id>
  GET  /episodes/<id>/v1/models, /v1/models the served model (``model_name``)

Of the Chat Completions API this covers: ``messages`` (system, developer (as system), user, assistant with
``tool_calls``, tool; content as text or text parts), ``tools`` (function tools, shown to the model by the chat
template), ``max_tokens`` / ``max_completion_tokens`` (capped by the episode's limits), ``stop``, ``n`` = 1,
``stream`` (true: the finished completion is sent as server-sent events, so streaming clients work, but nothing is
sent before generation ends), ``stream_options.include_usage``; the reply has ``choices[0].message`` with
``content`` and ``tool_calls`` (Qwen-style ``<tool_call>{json}</tool_call>`` blocks of the output),
``finish_reason`` "stop" / "length" / "tool_calls", and ``usage``.  ``temperature``, ``top_p``, ``top_k`` and
``seed`` are taken from the episode's ``SamplingSpec`` (the run's ``rollout.sampling``) and the request's are
ignored, because the trainer recomputes logprobs at the run's temperature; ``request_sampling=True`` honours them
(serving, evaluation).  ``tool_choice`` and ``parallel_tool_calls`` are accepted and ignored.  ``logprobs: true``
puts each generated token's logprob (under the distribution it was sampled from) in ``choices[0].logprobs.content``;
``top_logprobs`` > 0 is refused (400: the engine returns the sampled token's logprob only).  Not covered: ``n`` > 1,
``response_format``, images and audio, the Responses and legacy Completions APIs.

Prompts, token for token.  The engine never sees a re-tokenised assistant turn.  A request whose messages are an
earlier call's messages, that call's reply (the content and tool calls sent back, compared as parsed values), then
new messages (tool results, a user turn), is prompted with that call's prompt ids, its completion ids as the engine
produced them (end-of-turn token included), and the ids of the new text only: what the template writes after the
assistant turn less the end-of-turn token the model wrote itself, the new messages and the generation prompt
(``ChatRenderer.env_turn``).  Any other request (the first of an episode, an edited history, a template that rewrote
an earlier turn) is rendered whole; ``calls.split_calls`` then starts a new sample there.

Limits per episode (``episode.Limits``): ``max_turns`` calls, ``max_turn_tokens`` per call, ``max_response``
tokens per sample (a call that would pass it starts a new sample, so a long episode becomes several samples), the
engine's ``context``.  A call past them is refused with 400 and recorded in ``EpisodeLog.refused``.

Errors are OpenAI-shaped JSON (``{"error": {"message", "type", "code"}}``) with a one-line message: 404 for an
episode that is not open (never opened, closed, timed out) or an unknown path, 400 for a malformed request or a
limit, 500 when the engine fails.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NoReturn, cast
from urllib.parse import urlsplit

from buffer.logs import logger

from ..engines.base import Completion, SamplingSpec
from .calls import Call
from .episode import ChatRenderer, Limits, TemplateError
from .requests import ChatRequest, Message, RequestError, bad_request, normalise_message, parse_request
from .tools import CLOSE, OPEN, Tool, ToolCall, parse_tool_calls

log = logger("endpoint")

# One completion of one prompt; called from many request threads at once, so it must be thread-safe (``Batcher``).
Complete = Callable[[list[int], SamplingSpec], Completion]
MAX_BODY = 64 << 20
_EPISODE_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
_ROUTE = re.compile(r"/episodes/([^/]+)/v1/(chat/completions|models)")
# As episode.run_episodes: each call of an episode draws a fresh stream from a seeded spec.
_SEED_STRIDE = 1_000_003
_UNLIMITED = 1 << 40


# ---------------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Exchange:
    """One answered call: the training record and what is needed to recognise its conversation again."""

    call: Call
    messages: list[Message]  # the request's, normalised as the template was given them
    reply: Message  # the assistant message sent back (OpenAI shape)
    keys: tuple[str, ...]  # comparison keys of ``messages``
    reply_key: str
    tools_key: str
    root: int  # prompt length of the sample this call belongs to (what its response budget counts from)


@dataclass
class EpisodeLog:
    exchanges: list[Exchange] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # one line per call refused for a limit

    @property
    def calls(self) -> list[Call]:
        return [x.call for x in self.exchanges]


@dataclass
class _Episode:
    complete: Complete
    version: Callable[[], int]
    sampling: SamplingSpec
    limits: Limits
    log: EpisodeLog = field(default_factory=EpisodeLog)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _key(m: Message) -> str:
    """What two messages must share to be the same turn.  The ids inside ``tool_calls`` are left out: an agent
    framework may rewrite them, and the template is given the call itself."""
    calls = [[c["function"]["name"], c["function"]["arguments"]] for c in m.get("tool_calls", [])]
    return json.dumps(
        {
            "role": m["role"],
            "content": m["content"],
            "name": m.get("name"),
            "id": m.get("tool_call_id"),
            "calls": calls,
        },
        sort_keys=True,
    )


def _tools_key(tools: list[Tool]) -> str:
    return json.dumps([t.schema for t in tools], sort_keys=True)


# ---------------------------------------------------------------------------------------------- replies


def reply_message(text: str) -> Message:
    """The assistant message of a completion's text: each well-formed ``<tool_call>`` block becomes a ``tool_calls``
    entry, everything else (a malformed call included, as the model wrote it) stays in ``content``."""
    calls: list[ToolCall] = []
    rest: list[str] = []
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            break
        end += len(CLOSE)
        (call,) = parse_tool_calls(text[start:end])
        if call.error is None:
            rest.append(text[pos:start])
            calls.append(call)
        else:
            rest.append(text[pos:end])
        pos = end
    rest.append(text[pos:])
    content = "".join(rest)
    if calls:  # the blocks' own line breaks are the template's layout, not the model's words
        content = content.strip()
    message: Message = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        message["tool_calls"] = [
            {
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in calls
        ]
    return message


def _finish(message: Message, engine_finish: str) -> str:
    if engine_finish == "stop" and message.get("tool_calls"):
        return "tool_calls"
    return "length" if engine_finish == "length" else "stop"


def _room(limits: Limits, n_prompt: int, root: int) -> tuple[int, int]:
    """(tokens this call may generate, the prompt length its sample starts from).

    Continuing the sample of the call it extends when there is room for one token more, else starting a new sample
    at this call (the rule ``calls.split_calls`` applies with the same budget)."""
    within = limits.max_response - (n_prompt - root)
    if within < 1:
        root, within = n_prompt, limits.max_response
    return min(limits.max_turn_tokens, limits.context - n_prompt, within), root


# ---------------------------------------------------------------------------------------------- the endpoint


class ChatEndpoint:
    """The HTTP server and the open episodes; ``handle`` is the whole protocol, the server only carries bytes."""

    def __init__(
        self,
        renderer: ChatRenderer,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str = "policy",
        request_sampling: bool = False,
    ):
        self.renderer = renderer
        self.host, self.port = host, port
        self.model_name = model_name
        self.request_sampling = request_sampling
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()
        self._render_lock = threading.Lock()  # a tokenizer is not promised to be safe across threads
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # lifecycle

    def start(self) -> ChatEndpoint:
        if self._server is None:
            self._server = _Server((self.host, self.port), self)
            self.port = self._server.server_address[1]
            self._thread = threading.Thread(
                target=self._server.serve_forever, daemon=True, name="chat-endpoint"
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            self._episodes.clear()

    def __enter__(self) -> ChatEndpoint:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def base_url(self, episode_id: str) -> str:
        return f"{self.url}/episodes/{episode_id}/v1"

    # episodes

    def open(
        self,
        complete: Complete,
        *,
        version: Callable[[], int] = lambda: 0,
        sampling: SamplingSpec | None = None,
        limits: Limits | None = None,
        episode_id: str | None = None,
    ) -> str:
        """Open an episode whose calls ``complete`` answers with ``sampling`` under ``limits``; its id
        (``base_url(id)`` is what the agent is given).  ``version()`` is the policy version at each call."""
        sampling = sampling or SamplingSpec()
        eid = episode_id or secrets.token_hex(8)
        if not _EPISODE_ID.fullmatch(eid):
            raise ValueError(f"episode id {eid!r}: expected 1 to 128 of A-Z a-z 0-9 . _ -")
        limits = limits or Limits(_UNLIMITED, sampling.max_tokens, _UNLIMITED, _UNLIMITED)
        with self._lock:
            if eid in self._episodes:
                raise ValueError(f"episode {eid!r} is already open")
            self._episodes[eid] = _Episode(complete, version, sampling, limits)
        return eid

    def close(self, episode_id: str) -> EpisodeLog:
        """End an episode (its later calls get 404) and give back what it recorded."""
        with self._lock:
            ep = self._episodes.pop(episode_id, None)
        if ep is None:
            return EpisodeLog()
        with ep.lock:
            return ep.log

    # protocol

    def handle(self, method: str, target: str, body: bytes) -> tuple[int, str, bytes]:
        """(status, content type, body) of one HTTP request."""
        try:
            return self._route(method, urlsplit(target).path.rstrip("/"), body)
        except RequestError as e:
            kind = "not_found_error" if e.status == 404 else "invalid_request_error"
            return _json(
                e.status, {"error": {"message": e.message, "type": kind, "param": None, "code": e.code}}
            )
        except Exception as e:
            log.exception("chat endpoint: %s %s failed", method, target)
            message = f"{type(e).__name__}: {e}".splitlines()[0][:500]
            return _json(
                500, {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
            )

    def _route(self, method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
        if method == "GET" and path == "/v1/models":
            return self._models()
        m = _ROUTE.fullmatch(path)
        if m is None:
            raise RequestError(
                404,
                f"no route {method} {path}; base URLs look like {self.url}/episodes/<episode_id>/v1",
                "no_route",
            )
        eid, what = m.groups()
        with self._lock:
            ep = self._episodes.get(eid)
        if ep is None:
            raise RequestError(
                404,
                f"episode {eid!r} is not open on this endpoint (never opened, finished or timed out)",
                "no_episode",
            )
        if (method, what) == ("GET", "models"):
            return self._models()
        if (method, what) != ("POST", "chat/completions"):
            raise RequestError(405, f"{method} {path}: use POST .../v1/chat/completions or GET .../v1/models")
        return self._chat(eid, ep, parse_request(body))

    def _models(self) -> tuple[int, str, bytes]:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "shardrl"}
        return _json(200, {"object": "list", "data": [model]})

    def _chat(self, eid: str, ep: _Episode, req: ChatRequest) -> tuple[int, str, bytes]:
        with ep.lock:
            made = len(ep.log.exchanges)
        if made >= ep.limits.max_turns:
            self._refuse(
                ep, f"episode {eid}: {made} calls made, the episode's limit (env.max_turns)", "turn_limit"
            )
        prompt_ids, root = self._prompt(ep, req)
        room, root = _room(ep.limits, len(prompt_ids), root)
        if room < 1:
            self._refuse(
                ep,
                f"episode {eid}: a prompt of {len(prompt_ids)} tokens leaves no room in the context "
                f"({ep.limits.context})",
                "context_length_exceeded",
            )
        spec = self._spec(ep, req, room, made)
        version = ep.version()
        try:
            c = ep.complete(prompt_ids, spec)
        except ValueError as e:  # what the engine refuses of a prompt (check_prompts)
            raise bad_request(str(e).splitlines()[0]) from None
        message = reply_message(c.response_text)
        call = Call(prompt_ids, list(c.response_ids), list(c.response_logprobs), version, c.finish_reason)
        ours = normalise_message("reply", message)
        x = Exchange(
            call,
            req.messages,
            message,
            tuple(_key(m) for m in req.messages),
            _key(ours),
            _tools_key(req.tools),
            root,
        )
        with self._lock:
            still_open = self._episodes.get(eid) is ep
        if not still_open:  # closed while generating (timed out): what it produced is not the episode's
            raise RequestError(404, f"episode {eid!r} ended while this call was generating", "no_episode")
        with ep.lock:
            ep.log.exchanges.append(x)
        logprobs = self._logprobs(c) if req.logprobs else None
        return self._reply(
            req, message, _finish(message, c.finish_reason), len(prompt_ids), len(c.response_ids), logprobs
        )

    def _logprobs(self, c: Completion) -> dict[str, Any]:
        """``choices[0].logprobs`` of a reply: each generated token, its text and its logprob under the
        distribution it was sampled from (the behaviour logprob the sample is trained with)."""
        content = []
        with self._render_lock:
            for t, lp in zip(c.response_ids, c.response_logprobs, strict=True):
                text = self.renderer.decode([t], special=True)
                content.append(
                    {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
                )
        return {"content": content}

    def _refuse(self, ep: _Episode, message: str, code: str) -> NoReturn:
        with ep.lock:
            ep.log.refused.append(message)
        raise bad_request(message, code)

    def _prompt(self, ep: _Episode, req: ChatRequest) -> tuple[list[int], int]:
        """The call's prompt ids and the prompt length of the sample it continues (its own when it starts one)."""
        keys = [_key(m) for m in req.messages]
        tools_key = _tools_key(req.tools)
        with ep.lock:
            earlier = list(ep.log.exchanges)
        for x in reversed(earlier):
            n = len(x.keys)
            if (
                x.tools_key != tools_key
                or len(keys) <= n
                or tuple(keys[:n]) != x.keys
                or keys[n] != x.reply_key
            ):
                continue
            try:
                with self._render_lock:
                    env = self.renderer.env_turn(
                        req.messages[: n + 1], req.messages[n + 1 :], req.tools, x.call.completion_ids
                    )
            except TemplateError:
                break  # the template rewrote an earlier turn: rendered whole below, a new sample
            return x.call.prompt_ids + x.call.completion_ids + env, x.root
        with self._render_lock:
            ids = self.renderer.encode(self.renderer.render(req.messages, req.tools, generation_prompt=True))
        return ids, len(ids)

    def _spec(self, ep: _Episode, req: ChatRequest, room: int, made: int) -> SamplingSpec:
        s = ep.sampling
        if self.request_sampling:
            s = replace(
                s,
                temperature=s.temperature if req.temperature is None else req.temperature,
                top_p=s.top_p if req.top_p is None else req.top_p,
                top_k=s.top_k if req.top_k is None else req.top_k,
                seed=s.seed if req.seed is None else req.seed,
            )
        seed = None if s.seed is None else s.seed + _SEED_STRIDE * made
        budget = room if req.max_tokens is None else min(room, req.max_tokens)
        return replace(s, n=1, max_tokens=budget, seed=seed, stop=list(dict.fromkeys([*s.stop, *req.stop])))

    def _reply(
        self,
        req: ChatRequest,
        message: Message,
        finish: str,
        n_prompt: int,
        n_completion: int,
        logprobs: dict[str, Any] | None = None,
    ) -> tuple[int, str, bytes]:
        head = {
            "id": f"chatcmpl-{secrets.token_hex(12)}",
            "created": int(time.time()),
            "model": req.model or self.model_name,
        }
        usage = {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_completion,
            "total_tokens": n_prompt + n_completion,
        }
        if not req.stream:
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
            return _json(200, {**head, "object": "chat.completion", "choices": [choice], "usage": usage})
        events = _events(head, message, finish, usage if req.include_usage else None, logprobs)
        return 200, "text/event-stream", events


def _events(
    head: dict[str, Any],
    message: Message,
    finish: str,
    usage: dict[str, int] | None,
    logprobs: dict[str, Any] | None = None,
) -> bytes:
    """The finished completion as the chunks a streaming client reads: role and content (with every token's
    logprob when asked), tool calls, the finish."""
    head = {**head, "object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], reason: str | None = None, lp: Any = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": reason}]}

    chunks = [chunk({"role": "assistant", "content": message["content"] or ""}, lp=logprobs)]
    for i, tc in enumerate(message.get("tool_calls", [])):
        chunks.append(chunk({"tool_calls": [{"index": i, **tc}]}))
    chunks.append(chunk({}, finish))
    if usage is not None:
        chunks.append({**head, "choices": [], "usage": usage})
    lines = [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
    return "".join(lines).encode()


def _json(status: int, obj: Any) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(obj).encode()


# ---------------------------------------------------------------------------------------------- HTTP


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a request still generating never holds the worker's exit

    def __init__(self, address: tuple[str, int], endpoint: ChatEndpoint):
        super().__init__(address, _Handler)
        self.endpoint = endpoint


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: an SDK's connection pool reuses its connections

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        endpoint = cast(_Server, self.server).endpoint
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            self.close_connection = True  # the body is not read, so the connection cannot be reused
            status, kind, data = _json(
                413 if length > MAX_BODY else 400,
                {
                    "error": {
                        "message": f"Content-Length must be 0 to {MAX_BODY}",
                        "type": "invalid_request_error",
                    }
                },
            )
        else:
            status, kind, data = endpoint.handle(method, self.path, self.rfile.read(length))
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("chat endpoint: " + format, *args)


# ---------------------------------------------------------------------------------------------- engine side
