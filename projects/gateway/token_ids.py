"""Exact tokens for client-driven training: a non-streamed chat completion with ``logprobs`` is
asked of the inference server with ``return_token_ids`` (our server's and vLLM's extension), and
every choice of the reply carries its sampled ``token_ids``, the ``prompt_token_ids`` the sampler
was given and the checkpoint that sampled it (``artweb_model``). OpenAI's client keeps unknown
fields on a ``Choice`` and ``model_dump`` writes them, so a trajectory built from the choices (OpenPipe
ART's) brings them back to the training job (training.runs.art_groups) untouched.

A client that asked for ``return_token_ids`` itself gets the top-level ``prompt_token_ids`` too;
one that did not gets only the choices' fields. Streams are relayed as they are (a client that
streams may ask ``return_token_ids``: each delta then carries its ids).
"""

from __future__ import annotations

import dataclasses
import json

from django.http import HttpResponse, JsonResponse

from projects.gateway.routing import ParsedChat, Route
from training.runs.art_groups import annotate_completion


def ask_for_token_ids(chat: ParsedChat) -> ParsedChat:
    request = chat.request
    if not request.logprobs or request.stream:
        return chat
    if request.return_token_ids:
        return dataclasses.replace(chat, annotate=True, keep_prompt_token_ids=True)
    decoded = {**chat.decoded, "return_token_ids": True}
    return ParsedChat(
        raw=json.dumps(decoded).encode(),
        decoded=decoded,
        request=dataclasses.replace(request, return_token_ids=True),
        annotate=True,
    )


def annotated(response: HttpResponse, route: Route) -> HttpResponse:
    """The reply with each choice's ids (see the module doc); other replies as they are."""
    if not route.chat.annotate or response.status_code != 200:
        return response
    try:
        body = json.loads(response.content)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return response
    if not isinstance(body, dict):
        return response
    annotate_completion(body, model=route.target.model_id, keep_prompt=route.chat.keep_prompt_token_ids)
    return JsonResponse(body)
